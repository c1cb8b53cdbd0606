"""Which process this is: one process, explicit flags, or a SLURM step; JAX's runtime joined.

Under `srun` (SLURM_JOB_ID and SLURM_STEP_NODELIST set, SLURM_NTASKS > 1) every task is one
process on the devices SLURM gave it: the GPUs it sees (with `--gpus-per-task`), its share of
the node's GPUs by SLURM_LOCALID (GPUs given per node), or without GPUs one fake CPU device per
CPU of the task (SLURM_CPUS_PER_TASK; unset, RunConfig.cpu_devices). The coordinator is the
step's first node. Explicit `--coordinator_address/--num_processes/--process_id` take
precedence, and without either this is a single process. A process that dies is noticed by
the others through the coordination service's heartbeats, which stops them (non-zero) instead
of leaving them in a collective.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from longt5_jax.errors import UsageError

PORT = 61337  # the coordinator's default port (offset by the job id under SLURM)


@dataclasses.dataclass(frozen=True)
class Processes:
    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None  # accelerators this process uses
    source: str = "flags"
    cpu_devices: int = 0  # fake CPU devices of a task SLURM gave no GPU (0: the config's)

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
        gpus = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
        return Processes(
            f"{first_host(env['SLURM_STEP_NODELIST'])}:{port}",
            ntasks,
            int(env.get("SLURM_PROCID", "0")),
            _slurm_gpus(len(gpus), env),
            source="slurm",
            cpu_devices=0 if gpus else int(env.get("SLURM_CPUS_PER_TASK", "0")),
        )
    return None


def _slurm_gpus(visible: int, env: Mapping[str, str]) -> tuple[int, ...] | None:
    """The local GPU ids of this task: None (all it sees) when SLURM bound GPUs to the task,
    else its SLURM_LOCALID-th share of the node's (every task on the node sees them all)."""
    local = int(env.get("SLURM_LOCALID", "0"))
    if not visible:  # SLURM manages no GPUs here: GPU number SLURM_LOCALID, if there are any
        return (local,)
    bound = "SLURM_GPUS_PER_TASK" in env or visible < int(env.get("SLURM_GPUS_ON_NODE", visible))
    tasks = tasks_on_node(
        env.get("SLURM_STEP_TASKS_PER_NODE", "1"), int(env.get("SLURM_NODEID", "0"))
    )
    if bound or tasks == 1:
        return None
    share = visible // tasks
    if share == 0:
        raise ValueError(
            f"{tasks} tasks on a node share {visible} GPUs: ask SLURM for --gpus-per-task"
        )
    return tuple(range(local * share, (local + 1) * share))


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """The task count of node `node` from SLURM's compressed list: '4(x2),3' -> 4, 4, 3."""
    counts = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}: not a task list")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts[node]


def initialize(processes: Processes | None, cpu_devices: int, heartbeat_s: int = 20) -> None:
    """Join JAX's distributed runtime (before any other JAX call), and set log prefixes."""
    if processes is None:
        return

    # jax's Config sets its options as attributes at run time; its type declares none.
    platforms = jax.config.jax_platforms  # type: ignore[attr-defined]
    on_cpu = platforms in (None, "", "cpu") and cpu_devices > 0
    if on_cpu:  # fake CPU devices per process, reduced over gloo across processes
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service installs its own SIGTERM handler here, over the run's: SIGTERM
    # would never reach the training loop, which stops every process at one step and saves it.
    jax.config.update("jax_enable_preemption_service", False)
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


def agree(flag: bool, combine=all) -> bool:
    """`combine` (all or any) of `flag` over every process; each process learns the answer."""

    if jax.process_count() == 1:
        return flag

    return bool(combine(multihost_utils.process_allgather(np.asarray(flag))))
