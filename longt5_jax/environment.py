"""The process environment a command starts in: XLA_FLAGS, JAX_PLATFORMS, the cache variables
and the metrics port, each checked the same way by every command's start-up (`cli.run`) and by
`python -m longt5_jax.doctor`.

XLA aborts a process whose XLA_FLAGS holds a flag it does not know (a fatal log, no exception to
catch), so the flags are tried in a throwaway process that starts only XLA's CPU client (fast:
no jax import, no accelerator touched; a string that passed is not tried again). A platform in
JAX_PLATFORMS that is absent shows when jax first starts its backends (a bare AssertionError or
RuntimeError from jax's backend set-up); the platforms present are then asked of a process
without the variable.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
import uuid
from pathlib import Path

import jax

from longt5_jax.errors import UsageError

CACHES = {  # the variables naming a directory a run writes derived files to, and what they hold
    "LONGT5_JAX_CACHE": "tokenizers and decompressed data",
    "JAX_COMPILATION_CACHE_DIR": "compiled programs",
}
_PROBE_FLAGS = "import jaxlib._jax as x; x.get_tfrt_cpu_client(asynchronous=False)"
_PROBE_PLATFORMS = (
    "import jax; from jax._src import xla_bridge as b; print(' '.join(sorted(b.backends())))"
)
_ACCEPTED: set[str] = set()  # XLA_FLAGS strings XLA accepted in this process


def unknown_xla_flags(flags: str | None = None) -> str:
    """The flags of `flags` (default: $XLA_FLAGS) that XLA does not know, as it names them
    ('' when it accepts them all)."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    if not flags.strip() or flags in _ACCEPTED:
        return ""
    env = {**os.environ, "XLA_FLAGS": flags, "TF_CPP_MIN_LOG_LEVEL": "0"}
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE_FLAGS], env=env, capture_output=True, text=True, timeout=120
    )
    found = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", probe.stderr)
    if found:
        return found.group(1).strip()
    if probe.returncode == 0:
        _ACCEPTED.add(flags)
    return ""


def without_flags(flags: str, unknown: str) -> str:
    """`flags` less the `unknown` ones (matched by name)."""
    names = {f.split("=", 1)[0] for f in unknown.split()}
    return " ".join(f for f in flags.split() if f.split("=", 1)[0] not in names)


def check_xla_flags() -> None:
    """Refuse, in one line naming them, flags XLA would abort the process on."""
    unknown = unknown_xla_flags()
    if unknown:
        raise UsageError(
            f"XLA_FLAGS: XLA does not know {unknown}: remove it, or check its spelling against "
            "the jaxlib installed"
        )


def platforms_present() -> list[str]:
    """The platforms jax starts here without JAX_PLATFORMS (e.g. ['cpu', 'cuda'])."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["XLA_FLAGS"] = without_flags(env.get("XLA_FLAGS", ""), unknown_xla_flags())
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE_PLATFORMS], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    lines = probe.stdout.strip().splitlines()
    return lines[-1].split() if probe.returncode == 0 and lines else []


def requested_platforms() -> list[str]:
    """The platforms JAX_PLATFORMS names ([] where unset)."""
    return [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]


def absent_platforms(present: list[str]) -> list[str]:
    """The platforms JAX_PLATFORMS asks for that are not `present` ('gpu' is cuda or rocm)."""
    alias = {"gpu": {"cuda", "rocm"}}
    return [p for p in requested_platforms() if not alias.get(p, {p}) & set(present)]


def platforms_line(present: list[str]) -> str:
    absent = absent_platforms(present)
    return (
        f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')}: {', '.join(absent)} absent "
        f"here; the platforms present are {', '.join(present) or 'none'} (set JAX_PLATFORMS "
        "to one of them, or unset it)"
    )


def platform_failure(e: BaseException) -> str | None:
    """The one line for jax failing to start the backends JAX_PLATFORMS asks for, None where
    `e` is something else."""
    frames = traceback.extract_tb(e.__traceback__)
    in_bridge = any(f.filename.endswith("xla_bridge.py") for f in frames[-3:])
    if not (requested_platforms() and in_bridge and isinstance(e, (RuntimeError, AssertionError))):
        return None
    present = platforms_present()
    return platforms_line(present) if absent_platforms(present) else None


def port_problem(port: int, host: str = "127.0.0.1", name: str = "RunConfig.prometheus_port"):
    """Why `port` cannot be served on `host` (out of range, or taken), None where it can; 0 is
    off."""
    if not 0 <= port <= 65535:
        return f"{name}={port}: expected a port in 0-65535 (0: off)"
    if port == 0:
        return None
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return f"{name}={port}: {host}:{port} is taken ({e.strerror or e})"
    return None


def check_port_range(port: int, name: str = "RunConfig.prometheus_port") -> None:
    if not 0 <= port <= 65535:
        raise UsageError(port_problem(port, name=name))


def writable_problem(path: Path) -> str | None:
    """Why files cannot be written at or under `path`, None where they can. The directory
    itself (or, where it does not exist yet, its nearest existing ancestor) is tried with a
    probe file, created and removed: permission bits alone do not say (root ignores them; a
    read-only mount or an immutable directory does not)."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a directory"
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    probe = existing / f".longt5-probe-{uuid.uuid4().hex[:12]}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return f"{existing} is not writable ({e.strerror or e})"
    return None


def cache_problems() -> dict[str, str]:
    """Each cache variable that is set to a place that cannot be written, and why."""
    found = {}
    for name in CACHES:
        value = os.environ.get(name)
        if value:
            problem = writable_problem(Path(value))
            if problem:
                found[name] = problem
    return found


def drop_unusable_caches() -> None:
    """A cache variable naming an unwritable place costs the cache, not the run: one warning
    naming the variable, and the run goes on without it (compiled programs not kept; derived
    files in a directory of this process, removed at exit)."""
    for name, problem in cache_problems().items():
        print(
            f"warning: {name}={os.environ[name]}: {problem}; running without the cache of "
            f"{CACHES[name]}",
            file=sys.stderr,
        )
        if name == "JAX_COMPILATION_CACHE_DIR":
            del os.environ[name]  # jax read it at import: its setting is undone too
            jax.config.update("jax_compilation_cache_dir", None)
        else:
            private = tempfile.mkdtemp(prefix="longt5_jax-cache-")
            atexit.register(shutil.rmtree, private, ignore_errors=True)
            os.environ[name] = private


def startup() -> None:
    """What every command checks before jax starts: XLA_FLAGS XLA knows (else one line), and
    cache variables it can write (else one warning and no cache)."""
    check_xla_flags()
    drop_unusable_caches()
