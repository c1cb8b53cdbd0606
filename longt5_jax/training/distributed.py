"""Which process this is: one process, explicit flags, or a SLURM step; JAX's runtime joined.

Under `srun` (SLURM_JOB_ID and SLURM_STEP_NODELIST set, SLURM_NTASKS > 1) every task is one
process with one GPU (its SLURM_LOCALID); the coordinator is the step's first node. Explicit
`--coordinator_address/--num_processes/--process_id` take precedence, and without either this
is a single process. A process that dies is noticed by the others through the coordination
service's heartbeats, which stops them (non-zero) instead of leaving them in a collective.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping, Sequence

from longt5_jax.cli import UsageError

PORT = 61337  # the coordinator's default port (offset by the job id under SLURM)


@dataclasses.dataclass(frozen=True)
class Processes:
    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None  # accelerators this process uses
    source: str = "flags"

    def __post_init__(self):
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id={self.process_id} with num_processes={self.num_processes}: "
                "expected 0 <= process_id < num_processes"
            )
        if not re.fullmatch(r"[\w.\-\[\]:]+:\d+", self.coordinator_address):
            raise ValueError(
                f"coordinator_address={self.coordinator_address!r}: expected HOST:PORT"
            )


FLAGS = ("--coordinator_address", "--num_processes", "--process_id")


def split_flags(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """(the distributed flags given, the other arguments); `--flag=v` and `--flag v` both work."""
    found, rest, args = {}, [], iter(argv)
    for arg in args:
        name, sep, value = arg.partition("=")
        if name in FLAGS:
            found[name[2:]] = value if sep else next(args, "")
        else:
            rest.append(arg)
    return found, rest


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[07-09,12],cpu3' -> 'gpu07'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m or not m[1]:
        raise ValueError(f"SLURM_STEP_NODELIST={nodelist!r}: not a node list")
    return m[1] + (re.split(r"[,-]", m[2])[0] if m[2] else "")


def detect(flags: Mapping[str, str], env: Mapping[str, str] = os.environ) -> Processes | None:
    """The processes of this run: from `flags`, from a SLURM step, or None (one process)."""
    if flags:
        missing = [f for f in FLAGS if f[2:] not in flags]
        if missing:
            raise ValueError(f"{', '.join(missing)} missing: give all three distributed flags")
        try:
            count, index = int(flags["num_processes"]), int(flags["process_id"])
        except ValueError:
            raise ValueError(
                f"--num_processes={flags['num_processes']!r} --process_id="
                f"{flags['process_id']!r}: expected integers"
            ) from None
        return Processes(flags["coordinator_address"], count, index)
    if "SLURM_JOB_ID" in env and "SLURM_STEP_NODELIST" in env:
        ntasks = int(env.get("SLURM_NTASKS", "1"))
        if ntasks == 1:
            return None
        port = PORT + int(env["SLURM_JOB_ID"]) % 1000
        return Processes(
            f"{first_host(env['SLURM_STEP_NODELIST'])}:{port}",
            ntasks,
            int(env.get("SLURM_PROCID", "0")),
            (int(env.get("SLURM_LOCALID", "0")),),
            source="slurm",
        )
    return None


def initialize(processes: Processes | None, cpu_devices: int, heartbeat_s: int = 20) -> None:
    """Join JAX's distributed runtime (before any other JAX call), and set log prefixes."""
    if processes is None:
        return
    import jax

    on_cpu = jax.config.jax_platforms in (None, "", "cpu") and cpu_devices > 0
    if on_cpu:  # fake CPU devices per process, reduced over gloo across processes
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            processes.coordinator_address,
            processes.num_processes,
            processes.process_id,
            local_device_ids=None if on_cpu else processes.local_device_ids,
            # A dead peer is declared after this long without heartbeats; the survivors then stop.
            heartbeat_timeout_seconds=heartbeat_s,
            initialization_timeout=120,
        )
    except RuntimeError as e:  # unreachable coordinator, a peer that never came, a port in use
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"--coordinator_address={processes.coordinator_address}: process "
            f"{processes.process_id} of {processes.num_processes} could not join ({reason})"
        ) from None
    if not os.environ.get("LONGT5_JAX_PREFIXED"):  # the local launcher prefixes for us
        prefix = f"[{processes.process_id}/{processes.num_processes}] "
        sys.stdout = _Prefixed(sys.stdout, prefix)
        sys.stderr = _Prefixed(sys.stderr, prefix)


class _Prefixed:
    """A text stream that starts every line with `prefix`."""

    def __init__(self, stream, prefix: str):
        self._stream, self._prefix, self._fresh = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            out.append((self._prefix if self._fresh else "") + piece)
            self._fresh = piece.endswith("\n")
        self._stream.write("".join(out))
        return len(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)
