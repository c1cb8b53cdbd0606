"""Several processes: shared storage (process 0 writes a token under MODEL_DIR that every other
process must read), one all-reduce over every device, and every process's rows gathered for
process 0 to print, each named by its process and host. Every process calls these in the same
order (they are collectives)."""

from __future__ import annotations

import json
import secrets
import socket
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from longt5_jax.doctor.report import Row, fail, ok
from longt5_jax.errors import first_line

TOKEN = ".doctor-token"


def where() -> str:
    return f"process {jax.process_index()} on {socket.gethostname()}"


def _made_dirs(path: Path) -> list[Path]:
    """The directories `mkdir -p path` would create, deepest first."""
    return [p for p in (path, *path.parents) if not p.exists()]


def shared_storage_row(model_dir: Path | None) -> Row:
    """Process 0 writes a random token under MODEL_DIR (made for the check and removed after,
    where it did not exist); every other process reads it back."""
    secret = np.zeros(16, np.uint8)
    made: list[Path] = []
    problem = ""
    if jax.process_index() == 0 and model_dir is not None:
        made = _made_dirs(model_dir)
        try:
            model_dir.mkdir(parents=True, exist_ok=True)
            secret = np.frombuffer(secrets.token_bytes(16), np.uint8).copy()
            (model_dir / TOKEN).write_bytes(secret.tobytes())
        except OSError as e:
            problem = f"process 0 could not write {model_dir / TOKEN} ({e.strerror or e})"
    secret = np.asarray(multihost_utils.broadcast_one_to_all(secret))
    if model_dir is not None and jax.process_index() != 0 and not problem:
        try:
            read = (model_dir / TOKEN).read_bytes()
        except OSError as e:
            read, problem = b"", f"{e.strerror or e}"
        if read != secret.tobytes():
            problem = (
                f"cannot read the token process 0 wrote at {model_dir / TOKEN}"
                f"{f' ({problem})' if problem else ''}: MODEL_DIR is not shared storage"
            )
    multihost_utils.sync_global_devices("longt5_jax.doctor token read")
    if jax.process_index() == 0 and model_dir is not None:
        (model_dir / TOKEN).unlink(missing_ok=True)
        for d in made:
            d.rmdir()
    if model_dir is None:
        return ok("processes", "shared storage", "not checked (no MODEL_DIR)")
    if problem:
        return fail(
            "processes",
            "shared storage",
            problem,
            "put MODEL_DIR on storage every node mounts at the same path",
        )
    return ok(
        "processes",
        "shared storage",
        f"process 0 wrote a token in {model_dir}, every other process read it "
        "(one that could not is named below)",
    )


def all_reduce_row() -> Row:
    """A sum over every device of every process: the collective path a step's reductions take."""
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("all",))
    ones = np.ones(jax.local_device_count(), np.float32)
    x = multihost_utils.host_local_array_to_global_array(ones, mesh, PartitionSpec("all"))
    try:
        total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(x)
        got = float(jax.device_get(total.addressable_data(0)))
    except Exception as e:  # a collective that cannot run here (NCCL, gloo, the network)
        reason = first_line(e)
        return fail(
            "processes",
            "all-reduce",
            f"{where()}: {reason}",
            "check the network between the nodes (NCCL_SOCKET_IFNAME, NCCL_IB_HCA)",
        )
    if got != n:
        return fail(
            "processes",
            "all-reduce",
            f"{where()}: a sum over {n} devices gave {got}",
            "check the interconnect (NCCL_DEBUG=WARN shows the transport)",
        )
    return ok(
        "processes",
        "all-reduce",
        f"a sum over all {n} devices of {jax.process_count()} processes is {got:.0f}",
    )


def gather(rows: list[Row]) -> list[Row]:
    """For process 0: its own rows plus every other process's warns and fails that differ from
    its own, each named by its process and host (the others' ok rows repeat process 0's)."""
    mine = [r.__dict__ | {"detail": f"{where()}: {r.detail}"} for r in rows if r.status != "ok"]
    seen = {(r.check, r.detail) for r in rows}  # a problem every process has is said once
    data = np.frombuffer(json.dumps(mine).encode(), np.uint8)
    longest = int(np.max(multihost_utils.process_allgather(np.int32(len(data)))))
    padded = np.zeros(longest, np.uint8)
    padded[: len(data)] = data
    every = np.asarray(multihost_utils.process_allgather(padded))
    out = list(rows)
    for index, raw in enumerate(every):
        if index != jax.process_index():
            found = json.loads(bytes(raw).rstrip(b"\0").decode() or "[]")
            out += [
                Row(**r) for r in found if (r["check"], r["detail"].split(": ", 1)[1]) not in seen
            ]
    return out
