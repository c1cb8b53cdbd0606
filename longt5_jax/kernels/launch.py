"""Triton's launch settings of each kernel by name (warps, pipelining stages, how a program's
work is split, keys a tile), and the names every kernel goes by. What each setting measured is
in docs/journal.md (the kernels' section)."""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch

# Triton's warps and software-pipelining stages by kernel name (fnmatch patterns, first match
# wins), timed on an H100 and an H200 (`bench kernels --launch`; the figures are in
# docs/journal.md, "Launch settings"). An optional fourth number splits the work of a program
# of the forward and dq into that many (1 if not given): the encoder's query blocks
# (`encoder_geometry.Geometry.splits`), the decoder's cross-attention keys
# (`decoder_tiles.Tiles.split`). An optional fifth caps an encoder kernel's keys a tile and
# loops the forward's and dq's local keys (`Geometry.splits`).
LAUNCH: tuple[tuple, ...] = (
    ("encoder_local_attention_fwd", 4, 3, 2),
    ("encoder_local_attention_dq", 4, 3, 2),
    ("encoder_*", 8, 3),
    ("*_fwd", 4, 2),
    ("decoder_attention_dkv", 4, 2),
    ("*", 8, 2),
)


# Every kernel's name (`call` refuses others): what the launch patterns match, so that `bench
# kernels` can tell which kernels a setting sets. TGlobal's and Local's encoder families
# (`encoder_geometry.Geometry.kernel`; only TGlobal has side keys) and the decoder's.
KERNELS: tuple[str, ...] = (
    *(f"encoder_attention_{part}" for part in ("fwd", "dq", "dkv", "dside", "dbias")),
    *(f"encoder_local_attention_{part}" for part in ("fwd", "dq", "dkv", "dbias")),
    *(f"decoder_attention_{part}" for part in ("fwd", "dq", "dkv", "dbias")),
)


_LAUNCH: contextvars.ContextVar = contextvars.ContextVar("kernel_launch", default=LAUNCH)


def launch(settings: tuple[tuple, ...]):
    """Kernels traced inside this launch with `settings` ((pattern, warps, stages[, split[,
    keys]]), first match wins; names no pattern matches keep `LAUNCH`'s): how `bench kernels`
    tries others."""
    return bound(_LAUNCH, tuple(settings) + LAUNCH)


@contextlib.contextmanager
def bound(var: contextvars.ContextVar, value):
    """`var` set to `value` inside this."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def launch_of(name: str, wide: bool = False) -> dict:
    """Triton's launch settings of kernel `name`; `wide`: its tiles are float32, which take
    twice the shared memory per stage (at 3 stages the side gradient's kernel asked 264 KiB,
    where an H100 has 227), so at most 2 stages."""
    warps, stages = _setting(name)[1:3]
    return {"num_warps": warps, "num_stages": min(stages, 2) if wide else stages}


def kernels_set_by(settings: tuple[tuple, ...]) -> set[str]:
    """The kernels of `KERNELS` that launch `settings` set (a pattern of theirs matches)."""
    return {k for k in KERNELS if any(fnmatch.fnmatchcase(k, s[0]) for s in settings)}


def split_of(name: str) -> int:
    """Into how many programs kernel `name` splits a program's work (its launch setting's
    fourth number; 1 if none)."""
    setting = _setting(name)
    return setting[3] if len(setting) > 3 else 1


def keys_of(name: str) -> int:
    """At most how many keys encoder kernel `name` takes a tile (its launch setting's fifth
    number; 0 if none: the geometry's own, `encoder_geometry.Geometry.splits`)."""
    setting = _setting(name)
    return setting[4] if len(setting) > 4 else 0


def _setting(name: str) -> tuple:
    return next(s for s in _LAUNCH.get() if fnmatch.fnmatchcase(name, s[0]))
