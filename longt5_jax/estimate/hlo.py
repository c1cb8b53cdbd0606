"""Reading a compiled step's optimised HLO (parsed by `estimate/hlo_module.py`): the bytes its
collectives move per device, on which mesh axes and links; and its memory from XLA's buffer
assignment.

Works on the GPU compiler's HLO (asynchronous `*-start`/`*-done` pairs, counted once at the
start; tuples of many arrays combined into one collective; replica groups in explicit, iota and
mesh spellings) and the CPU compiler's (synchronous ops). An op inside a while loop (the scans
over layers, accumulation microbatches, pipeline iterations) runs once per iteration, so it is
multiplied by the loop's trip count (XLA's `known_trip_count`, or the bound in the condition).
Bytes per device follow the ring algorithms NCCL uses for large messages (S the full buffer, N
the replica-group size):

    all-reduce 2 (N-1)/N S    all-gather, reduce-scatter, all-to-all (N-1)/N S
    collective-permute S (each device sends its buffer once)

S is read from the operands' types: an all-gather's operand is one shard (S = N x operand), a
reduce-scatter's the whole buffer. CPU GSPMD lowers a reduce-scatter as all-reduce +
dynamic-slice; the parser reports ops as found and never renames them.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

import numpy as np

from longt5_jax.estimate.hlo_module import (
    Computation,
    Instr,
    Module,
    arrays,
    largest_array_bytes,
    shape_bytes,
)

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def ring_bytes(kind: str, payload: float, group_size: int) -> float:
    """Bytes one device sends for a collective over a buffer of `payload` bytes (see above)."""
    n = group_size
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * payload
    if kind == "collective-permute":
        return float(payload)
    return (n - 1) / n * payload


def _iota(shape: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return (ids if perm is None else ids.transpose(perm)).reshape(-1)


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _tile(text: str) -> np.ndarray:
    """Device ids of an iota tile `[4,2]T(1,0)` or `[8]`."""
    m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    if m is None:
        raise ValueError(text)
    return _iota(_ints(m.group(1)), _ints(m.group(2)) if m.group(2) else None)


def replica_groups(attrs: str, num_devices: int) -> tuple[tuple[int, ...], ...] | None:
    """The device groups of a collective, from any of XLA's three spellings; None if unknown."""
    m = re.search(r"replica_groups=(\{\}|\{\{[\d,{}]*\}\})", attrs)
    if m:
        if m.group(1) == "{}":
            return (tuple(range(num_devices)),)
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,]*)\}", m.group(1)[1:-1]))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", attrs)
    if m:
        ids = _tile(m.group(3)).reshape(int(m.group(1)), int(m.group(2)))
        return tuple(tuple(int(d) for d in g) for g in ids)
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))? \{([^}]*)\}", attrs
    )
    if m:
        try:
            return _mesh_groups(m.group(1), m.group(2), m.group(3))
        except ValueError:
            return None
    return None


def _mesh_groups(axes: str, device_ids: str | None, grouped: str) -> tuple[tuple[int, ...], ...]:
    """Groups of a mesh-spelled collective: devices that differ only along the `grouped` axes."""
    parsed = re.findall(r"'([^']+)'=(\d+)", axes)
    if len(parsed) != axes.count("="):
        raise ValueError(axes)  # sub-axes and other spellings this parser does not know
    names, sizes = [n for n, _ in parsed], [int(s) for _, s in parsed]
    ids = _tile(device_ids) if device_ids else np.arange(int(np.prod(sizes)))
    ids = ids.reshape(sizes)
    chosen = [names.index(a) for a in re.findall(r"'([^']+)'", grouped)]
    rest = [i for i in range(len(names)) if i not in chosen]
    group = int(np.prod([sizes[i] for i in chosen]))
    ids = ids.transpose(rest + chosen).reshape(-1, group)
    return tuple(tuple(int(d) for d in g) for g in ids)


def _pairs(attrs: str) -> tuple[tuple[int, ...], ...]:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    pairs = re.findall(r"\{(\d+),(\d+)\}", m.group(1) + "}") if m else []
    return tuple((int(s), int(t)) for s, t in pairs if s != t)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the program; `payload` is the full buffer S (module docstring)."""

    kind: str
    payload: int
    group_size: int
    groups: tuple[tuple[int, ...], ...] | None  # partition ids; permutes: (source, target)
    count: int  # executions per step (enclosing loops' trip counts multiplied)
    name: str
    computation: str
    in_loop: bool  # inside a while body (runs per iteration of some loop)

    @property
    def bytes_per_device(self) -> float:
        """Bytes per device over the whole step (ring model x executions)."""
        return self.count * ring_bytes(self.kind, self.payload, self.group_size)

    def spans(self, devices_per_node: int) -> bool:
        """Whether some group joins partitions on different nodes, partition d on node
        d // devices_per_node (a mesh laid over the devices in order)."""
        if self.groups is None:
            return True  # unknown groups: assume the slow path
        return any(len({d // devices_per_node for d in g}) > 1 for g in self.groups)


def _operand_bytes(comp: Computation, instr: Instr) -> int | None:
    sizes = [comp.types.get(o) for o in instr.operands]
    known = [s for s in sizes if s is not None]
    if not sizes or len(known) < len(sizes):
        return None
    return sum(shape_bytes(s) for s in known)


def _payload(kind: str, comp: Computation, instr: Instr, size: int) -> int:
    """The full buffer S: from the operands' types, else the largest array of the result."""
    operands = _operand_bytes(comp, instr)
    if kind == "collective-permute" and operands is not None and "slice_sizes=" in instr.attrs:
        operands = shape_bytes(comp.types[instr.operands[0]])  # in place: the input alone
    if operands is not None:
        return operands * size if kind == "all-gather" else operands
    if instr.type.startswith("("):  # an async start's (operands, results): the full buffer
        return largest_array_bytes(instr.type)
    return shape_bytes(instr.type) * (size if kind == "reduce-scatter" else 1)


def collectives(hlo: str | Module) -> list[Collective]:
    """Every collective in an optimised HLO module, with its executions per step."""
    module = hlo if isinstance(hlo, Module) else Module.parse(hlo)
    in_loop = module.loop_bodies()
    found = []
    for comp, times in module.scheduled():
        for instr in comp.instrs:
            kind = instr.opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            groups: tuple[tuple[int, ...], ...] | None
            if kind == "collective-permute":
                groups = _pairs(instr.attrs)
                size = 2 if groups else 1
            else:
                groups = replica_groups(instr.attrs, module.num_partitions)
                size = len(groups[0]) if groups else module.num_partitions
            payload = _payload(kind, comp, instr, size)
            loop = in_loop[comp.name]
            found.append(
                Collective(kind, payload, size, groups, times, instr.name, comp.name, loop)
            )
    return found


def bytes_by_kind(ops: list[Collective]) -> dict[str, float]:
    """Per-device bytes per step of each collective kind (ring model)."""
    totals = dict.fromkeys(KINDS, 0.0)
    for op in ops:
        totals[op.kind] += op.bytes_per_device
    return totals


# -- where collectives run: mesh axes and links -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
    """Partition p of the program runs on mesh coordinate unravel(p, shape) on node nodes[p]."""

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    nodes: tuple[int, ...]

    @classmethod
    def of(cls, mesh: Any, node_ids: list[int]) -> Placement:
        """For a jax Mesh, given the node of each of `mesh.devices.flat` (partition order)."""
        return cls(tuple(mesh.axis_names), tuple(mesh.devices.shape), tuple(node_ids))

    def axes(self, op: Collective) -> tuple[str, ...]:
        """The mesh axes along which the members of the op's groups differ."""
        if op.groups is None:
            return ("?",)
        varying: set[int] = set()
        for group in op.groups:
            coords = np.array([np.unravel_index(d, self.shape) for d in group])
            varying.update(np.nonzero((coords != coords[0]).any(axis=0))[0].tolist())
        return tuple(self.axis_names[a] for a in sorted(varying))

    def crosses(self, op: Collective) -> bool:
        """Whether some group (or permute pair) joins devices on different nodes."""
        if op.groups is None:
            return True  # unknown groups: assume the slow path
        return any(len({self.nodes[d] for d in g}) > 1 for g in op.groups)

    def link(self, op: Collective) -> str:
        """'nvlink' inside a node, 'ib' across nodes: a ring is as slow as its slowest link."""
        return "ib" if self.crosses(op) else "nvlink"


def bytes_by(ops: list[Collective], placement: Placement) -> dict[str, dict[str, float]]:
    """Per-device bytes per step by kind, by link and by (kind, mesh axes)."""
    by_link = {"nvlink": 0.0, "ib": 0.0}
    by_kind_link: dict[str, float] = collections.defaultdict(float)
    by_axes: dict[str, float] = collections.defaultdict(float)
    for op in ops:
        link, axes = placement.link(op), "+".join(placement.axes(op)) or "-"
        by_link[link] += op.bytes_per_device
        by_kind_link[f"{op.kind} {link}"] += op.bytes_per_device
        by_axes[f"{op.kind} over {axes}"] += op.bytes_per_device
    return {
        "kind": bytes_by_kind(ops),
        "link": by_link,
        "kind_link": dict(by_kind_link),
        "axes": dict(by_axes),
    }


# -- memory ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes of a compiled executable, from its buffer assignment."""

    arguments: int
    outputs: int
    aliased: int  # outputs written over donated arguments: counted once
    temporaries: int
    generated_code: int
    host: int = 0  # bytes in host memory (arguments + outputs - aliased + temporaries there)

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.generated_code

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def memory(compiled: Any) -> Memory:
    """Per-device memory of a `jax.stages.Compiled` (SPMD: every device runs the same program)."""
    m = compiled.memory_analysis()

    def host(field: str) -> int:
        return int(getattr(m, f"host_{field}_size_in_bytes", 0) or 0)

    return Memory(
        arguments=int(m.argument_size_in_bytes),
        outputs=int(m.output_size_in_bytes),
        aliased=int(m.alias_size_in_bytes),
        temporaries=int(m.temp_size_in_bytes),
        generated_code=int(m.generated_code_size_in_bytes),
        host=host("argument") + host("output") - host("alias") + host("temp"),
    )


@dataclasses.dataclass(frozen=True)
class HostTransfers:
    """Per-device bytes per step copied between host memory and the device (PCIe on a GPU):
    offloaded state coming in for the step, and going back."""

    to_device: float = 0.0
    to_host: float = 0.0

    @property
    def total(self) -> float:
        return self.to_device + self.to_host


def host_transfers(module: Module) -> HostTransfers:
    """The host <-> device copies of a compiled step: `copy-start` (asynchronous: its result is
    (destination, source, context)) or a plain `copy` whose operand sits in the other memory."""
    moved = {True: 0.0, False: 0.0}  # keyed by: to the device?
    for comp, times in module.scheduled():
        for instr in comp.instrs:
            if instr.opcode == "copy-start":
                pair = arrays(instr.type)[:2]
            elif instr.opcode == "copy" and instr.operands:
                pair = arrays(instr.type)[:1] + arrays(comp.types.get(instr.operands[0], ""))[:1]
            else:
                continue
            if len(pair) == 2 and pair[0][1] != pair[1][1]:
                moved[pair[1][1]] += pair[0][0] * times
    return HostTransfers(to_device=moved[True], to_host=moved[False])


def zero_volumes(
    zero_stage: int, grad_bytes: float, sharded_bytes: float, n: int, cpu: bool = True
) -> dict[str, float]:
    """Analytic per-device bytes of data parallelism over `n` devices under a ZeRO stage.

    `sharded_bytes` are the parameters ZeRO splits (those with an `embed` axis); the rest stay
    replicated and are all-reduced at every stage. Stage 1 all-gathers the updated parameters;
    stage 2 reduce-scatters their gradients instead (`cpu`: as the all-reduce CPU GSPMD emits);
    stage 3 gathers parameters for the forward and again for the backward pass (an upper bound:
    XLA keeps gathered weights that live outside the layer scans).
    """
    volumes = dict.fromkeys(KINDS, 0.0)
    scattered = zero_stage >= 2
    volumes["all-reduce"] = ring_bytes("all-reduce", grad_bytes - scattered * sharded_bytes, n)
    if scattered:
        kind = "all-reduce" if cpu else "reduce-scatter"
        volumes[kind] += ring_bytes(kind, sharded_bytes, n)
    if zero_stage >= 1:
        volumes["all-gather"] = (1 + (zero_stage == 3)) * ring_bytes("all-gather", sharded_bytes, n)
    return volumes


def summary(compiled: Any) -> dict[str, Any]:
    """Memory and collectives of a compiled step, as JSON-ready numbers."""
    ops = collectives(compiled.as_text())
    return {
        "memory": memory(compiled).as_dict(),
        "collective_bytes": bytes_by_kind(ops),
        "collective_ops": dict(collections.Counter(op.kind for op in ops)),
    }
