"""Reading a compiled step's optimised HLO: its computations, how often each runs, and the bytes
its collectives move per device; and its memory from XLA's buffer assignment.

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
from collections.abc import Iterator
from typing import Any

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = ")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_CALLEES = re.compile(
    r"\b(body|condition|calls|to_apply|branch_computations|true_computation|false_computation)="
    r"(\{[^}]*\}|%[\w.\-]+)"
)
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# Computations that run as scheduled code (their instructions are kernels or control flow), as
# opposed to fused bodies and reduction functions (`to_apply`).
_CONTROL = {"while": ("body", "condition"), "call": ("to_apply",), "async-start": ("calls",)}
_CONTROL["conditional"] = ("branch_computations", "true_computation", "false_computation")


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


def shape_bytes(type_text: str) -> int:
    """Bytes of an HLO type: an array `f32[4,8]{1,0}` or a tuple of them."""
    total = 0
    for dtype, dims in _SHAPE.findall(type_text):
        if dtype not in _DTYPE_BYTES and not dtype.startswith("f8"):
            continue  # token[] and the like carry no data
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * _DTYPE_BYTES.get(dtype, 1)
    return total


def dims(type_text: str) -> tuple[int, ...]:
    """The dimensions of an array type."""
    m = _SHAPE.search(type_text)
    return tuple(int(d) for d in m.group(2).split(",") if d) if m else ()


def _split_type(rest: str) -> tuple[str, str]:
    """(result type, remainder) of the text after `%name = `; tuple types nest parentheses."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :]
    raise ValueError(f"unbalanced HLO type: {rest[:80]}")


def _split_operands(text: str) -> tuple[str, str]:
    """(operand list, attributes) of the text after `opcode(`."""
    depth = 1
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return text[:i], text[i + 1 :]
    return text, ""


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]  # operand names
    args: str  # the text between the opcode's parentheses (a parameter's index, a constant)
    attrs: str
    root: bool = False


def instructions(hlo: str) -> Iterator[tuple[str, bool, Instr]]:
    """(computation, is it ENTRY, instruction) for every instruction of an HLO module's text."""
    computation, is_entry = None, False
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            computation, is_entry = header.group(2), bool(header.group(1))
            continue
        m = _INSTR.match(line)
        if computation is None or m is None:
            continue
        type_text, rest = _split_type(line[m.end() :])
        op = _OPCODE.match(rest)
        operands, attrs = _split_operands(rest[op.end() :]) if op else ("", rest)
        names = tuple(re.findall(r"%([\w.\-]+)", operands))
        opcode = op.group(1) if op else ""
        instr = Instr(m.group(2), type_text, opcode, names, operands, attrs, bool(m[1]))
        yield computation, is_entry, instr


@dataclasses.dataclass
class Computation:
    name: str
    instrs: list[Instr]
    types: dict[str, str]  # instruction name -> result type

    def users(self, name: str) -> list[Instr]:
        return [i for i in self.instrs if name in i.operands]

    @property
    def root(self) -> Instr:
        return next((i for i in self.instrs if i.root), self.instrs[-1])


@dataclasses.dataclass
class Module:
    """An HLO module: computations, the entry, and how many times each scheduled (non-fused)
    computation runs per execution of the entry."""

    computations: dict[str, Computation]
    entry: str
    num_partitions: int
    executions: dict[str, int]

    @classmethod
    def parse(cls, hlo: str) -> Module:
        comps: dict[str, Computation] = {}
        entry = ""
        for name, is_entry, instr in instructions(hlo):
            comp = comps.setdefault(name, Computation(name, [], {}))
            comp.instrs.append(instr)
            comp.types[instr.name] = instr.type
            entry = name if is_entry else entry
        m = re.search(r"num_partitions=(\d+)", hlo)
        module = cls(comps, entry, int(m.group(1)) if m else 1, {})
        module._count(entry, 1)
        return module

    def _count(self, name: str, times: int) -> None:
        if name not in self.computations:
            return
        self.executions[name] = self.executions.get(name, 0) + times
        for instr in self.computations[name].instrs:
            keys = _CONTROL.get(instr.opcode, ())
            callees = {k: re.findall(r"%?([\w.\-]+)", v) for k, v in _CALLEES.findall(instr.attrs)}
            factor = self._trip_count(instr, callees) if instr.opcode == "while" else 1
            for key in keys:
                for callee in callees.get(key, []):
                    self._count(callee, times * factor)

    def _trip_count(self, instr: Instr, callees: dict[str, list[str]]) -> int:
        m = _TRIP.search(instr.attrs)
        if m:
            return int(m.group(1))
        # No annotation (e.g. a loop the collective pipeliner peeled): the condition compares
        # the counter (tuple element i) with a constant; the counter starts at the constant
        # the caller put in element i of the loop's initial tuple.
        cond = self.computations.get(callees.get("condition", [""])[0])
        if cond is None:
            return 1
        counted = self._counted_loop(instr, cond)
        if counted is not None:
            return counted
        consts = [self._constant(cond, i.name) for i in cond.instrs if i.opcode == "constant"]
        consts = [c for c in consts if c is not None]
        return consts[0] if len(consts) == 1 else 1

    def _counted_loop(self, instr: Instr, cond: Computation) -> int | None:
        """`i < bound` (or <=) on tuple element k, k starting at a constant: the trip count."""
        compare, where = cond.root, cond
        if compare.opcode == "fusion":
            where = self.computations.get(compare.attrs.split("calls=%", 1)[-1].split(",")[0])
            compare = where.root if where else compare
        if compare.opcode != "compare" or where is None:
            return None
        bounds = [b for b in (self._constant(where, o) for o in compare.operands) if b is not None]
        index = re.search(r"index=(\d+)", " ".join(i.attrs for i in cond.instrs))
        caller = next((c for c in self.computations.values() if instr in c.instrs), None)
        if len(bounds) != 1 or index is None or caller is None:
            return None
        init = next((i for i in caller.instrs if i.name == instr.operands[0]), None)
        start = 0
        if init is not None and init.opcode == "tuple":
            start = self._constant(caller, init.operands[int(index.group(1))]) or 0
        return max(bounds[0] - start + ("direction=LE" in compare.attrs), 1)

    def _constant(self, comp: Computation, name: str) -> int | None:
        """The integer value of `name` if it is a constant (through copies and converts)."""
        by_name = {i.name: i for i in comp.instrs}
        instr = by_name.get(name)
        while instr is not None and instr.opcode in ("copy", "convert", "bitcast"):
            instr = by_name.get(instr.operands[0]) if instr.operands else None
        if instr is None or instr.opcode != "constant":
            return None
        m = re.fullmatch(r"\s*(-?\d+)\s*", instr.args)
        return int(m.group(1)) if m else None

    def scheduled(self) -> Iterator[tuple[Computation, int]]:
        """Each scheduled computation with its executions per step."""
        for name, times in self.executions.items():
            yield self.computations[name], times


# -- collectives ---------------------------------------------------------------------------------


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
    if not sizes or any(s is None for s in sizes):
        return None
    return sum(shape_bytes(s) for s in sizes)


def _payload(kind: str, comp: Computation, instr: Instr, size: int) -> int:
    """The full buffer S: from the operands' types, else the largest array of the result."""
    operands = _operand_bytes(comp, instr)
    if kind == "collective-permute" and operands is not None and "slice_sizes=" in instr.attrs:
        operands = shape_bytes(comp.types[instr.operands[0]])  # in place: the input alone
    if operands is not None:
        return operands * size if kind == "all-gather" else operands
    if instr.type.startswith("("):  # an async start's (operands, results): the full buffer
        return max((shape_bytes(f"{d}[{s}]") for d, s in _SHAPE.findall(instr.type)), default=0)
    return shape_bytes(instr.type) * (size if kind == "reduce-scatter" else 1)


def collectives(hlo: str | Module) -> list[Collective]:
    """Every collective in an optimised HLO module, with its executions per step."""
    module = hlo if isinstance(hlo, Module) else Module.parse(hlo)
    in_loop = _loop_bodies(module)
    found = []
    for comp, times in module.scheduled():
        for instr in comp.instrs:
            kind = instr.opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
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


def _loop_bodies(module: Module) -> dict[str, bool]:
    """Whether each scheduled computation runs inside some while loop's body."""
    inside = dict.fromkeys(module.executions, False)

    def mark(name: str, flag: bool) -> None:
        if name not in module.computations or (inside.get(name) and flag):
            return
        inside[name] = inside.get(name, False) or flag
        for instr in module.computations[name].instrs:
            callees = {k: re.findall(r"%?([\w.\-]+)", v) for k, v in _CALLEES.findall(instr.attrs)}
            for key in _CONTROL.get(instr.opcode, ()):
                for callee in callees.get(key, []):
                    mark(callee, flag or (instr.opcode == "while" and key == "body"))

    mark(module.entry, False)
    return inside


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
