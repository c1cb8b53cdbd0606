"""The software and devices: versions against the tested sets (the package's own pins, read
from its installed metadata: one source of truth) and what jax sees here."""

from __future__ import annotations

import importlib.metadata as metadata
import platform
import sys

import jax
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from longt5_jax.doctor.report import Row, fail, ok, warn

PACKAGES = ("jax", "jaxlib", "flax", "orbax-checkpoint")
PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def pins() -> dict[str, SpecifierSet]:
    """Each tested package's specifier for this Python, from longt5_jax's metadata (its core
    dependencies; an extra's pins where that extra names the package)."""
    found: dict[str, SpecifierSet] = {}
    for text in metadata.requires("longt5_jax") or []:
        req = Requirement(text)
        name = req.name.lower()
        # This environment with no extra selected: a core dependency's marker.
        core = req.marker is None or req.marker.evaluate({"extra": ""})
        if name in PACKAGES and core:
            found[name] = found.get(name, SpecifierSet()) & req.specifier
    return found


def _fix(name: str, spec: SpecifierSet) -> str:
    return f"pip install '{name}{spec}' (or reinstall: pip install -e '.[cuda12]' / '.[cuda13]')"


def rows() -> list[Row]:
    """Python, the tested packages and the CUDA plugins."""
    out = []
    python = platform.python_version()
    ours = metadata.metadata("longt5_jax")  # typed as PackageMetadata, which has no `get`
    pinned = ours["Requires-Python"] if "Requires-Python" in ours else ""  # noqa: SIM401
    needed = SpecifierSet(pinned)
    if python in needed:
        out.append(ok("software", "python", f"{python} ({sys.executable}; tested {needed})"))
    else:
        out.append(
            fail(
                "software",
                "python",
                f"{python}: not {needed}",
                f"use a Python {needed} environment",
            )
        )
    for name, spec in pins().items():
        have = _installed(name)
        if have is None:
            out.append(fail("software", name, "not installed", _fix(name, spec)))
        elif have in spec:
            out.append(ok("software", name, f"{have} (tested {spec})"))
        else:
            out.append(warn("software", name, f"{have}, not the tested {spec}", _fix(name, spec)))
    out += _plugins()
    return out


def _plugins() -> list[Row]:
    """The CUDA plugins must be jaxlib's own version (jax loads no other)."""
    jaxlib = _installed("jaxlib")
    out = []
    for name in PLUGINS:
        have = _installed(name)
        if have is None:
            continue
        if have == jaxlib:
            out.append(ok("software", name, f"{have} (jaxlib's)"))
        else:
            out.append(
                fail(
                    "software",
                    name,
                    f"{have}, but jaxlib is {jaxlib}: jax will not load it",
                    f"pip install '{name}=={jaxlib}'",
                )
            )
    if not out:
        out.append(
            ok(
                "software",
                "cuda plugin",
                "none installed (CPU only; GPU: pip install -e '.[cuda12]' or '.[cuda13]')",
            )
        )
    return out


def device_memory(device) -> int | None:
    """Bytes the allocator may use on `device`, where it says (GPUs do, CPUs do not)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend without the query
        stats = {}
    return stats.get("bytes_limit") or None


def device_rows() -> list[Row]:
    """The platform and the devices: kind, count, memory, compute capability and driver."""
    devices = jax.devices()
    first = jax.local_devices()[0]
    detail = f"{jax.default_backend()}: {len(devices)} x {first.device_kind}"
    if jax.process_count() > 1:
        detail += f" over {jax.process_count()} processes ({jax.local_device_count()} here)"
    memory = device_memory(first)
    detail += f", {memory / 2**30:.1f} GiB each" if memory else ", memory not reported"
    capability = getattr(first, "compute_capability", "")
    if capability:
        detail += f", compute capability {capability}"
    if first.platform != "cpu":
        detail += f", {first.client.platform_version.strip()}"
    return [ok("devices", "devices", detail)]
