"""What a compiled SPMD step costs each device: memory (XLA's buffer assignment) and the bytes
its collectives move, read from the optimised HLO.

Collectives are counted as XLA emitted them, per execution: an op inside a while loop (the scan
over layers, gradient-accumulation microbatches, pipeline iterations) runs once per iteration,
so it is multiplied by the loop's trip count (XLA's `known_trip_count`, or the bound in the
loop condition). Bytes per device follow the ring algorithms, the analytic model NCCL's rings
reach for large messages (S is the full buffer, N the replica-group size):

    all-reduce 2 (N-1)/N S    all-gather, reduce-scatter, all-to-all (N-1)/N S
    collective-permute S (each device sends its buffer once)

GSPMD on CPU lowers a reduce-scatter as all-reduce + dynamic-slice, so a CPU-compiled ZeRO-2
step shows all-reduce bytes where a GPU compile would show reduce-scatter: the parser reports
the ops as found and never renames them.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_CALLEES = re.compile(
    r"\b(body|condition|calls|to_apply|branch_computations)=(\{[^}]*\}|%[\w.\-]+)"
)
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


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


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of the HLO; `payload` is the full buffer S (module docstring)."""

    kind: str
    payload: int
    group_size: int
    groups: tuple[tuple[int, ...], ...] | None  # device (partition) ids; None if not parsed
    count: int  # executions per step (enclosing loops' trip counts multiplied)
    name: str

    @property
    def bytes_per_device(self) -> float:
        """Bytes per device over the whole step (ring model x executions)."""
        return self.count * ring_bytes(self.kind, self.payload, self.group_size)

    def spans(self, devices_per_node: int) -> bool:
        """Whether some group (or permute pair) joins devices on different nodes."""
        if self.groups is None:
            return True  # unknown groups: assume the slow path
        return any(len({d // devices_per_node for d in g}) > 1 for g in self.groups)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes of a compiled executable, from its buffer assignment."""

    arguments: int
    outputs: int
    aliased: int  # outputs written over donated arguments: counted once
    temporaries: int
    generated_code: int

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.generated_code

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def memory(compiled: Any) -> Memory:
    """Per-device memory of a `jax.stages.Compiled` (SPMD: every device runs the same program)."""
    m = compiled.memory_analysis()
    return Memory(
        arguments=int(m.argument_size_in_bytes),
        outputs=int(m.output_size_in_bytes),
        aliased=int(m.alias_size_in_bytes),
        temporaries=int(m.temp_size_in_bytes),
        generated_code=int(m.generated_code_size_in_bytes),
    )


def shape_bytes(type_text: str) -> int:
    """Bytes of an HLO type: an array `f32[4,8]{1,0}` or a tuple of them."""
    total = 0
    for dtype, dims in _SHAPE.findall(type_text):
        if dtype not in _DTYPE_BYTES and not dtype.startswith("f8"):
            continue  # token[] and the like carry no data
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * _DTYPE_BYTES.get(dtype, 1)
    return total


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


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
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


def instructions(hlo: str):
    """(computation, in ENTRY?, name, result type, opcode, attributes) of every HLO instruction."""
    computation, is_entry = None, False
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            computation, is_entry = header.group(2), bool(header.group(1))
            continue
        instr = _INSTR.match(line)
        if computation is None or instr is None:
            continue
        type_text, rest = _split_type(line[instr.end() :])
        op = _OPCODE.match(rest)
        yield (
            computation,
            is_entry,
            instr.group(1),
            type_text,
            op.group(1) if op else "",
            rest[op.end() :] if op else rest,
        )


@dataclasses.dataclass
class _Computation:
    collectives: list[tuple[str, str, str, str]]  # (name, opcode, type, attrs)
    calls: list[tuple[str, int]]  # (callee, executions per call)
    constants: list[int]


def _trip_count(attrs: str, condition: _Computation | None) -> int:
    m = _TRIP.search(attrs)
    if m:
        return int(m.group(1))
    # A scan's condition compares the counter with its length: the one integer constant there.
    if condition is not None and len(condition.constants) == 1:
        return condition.constants[0]
    return 1


def _parse(hlo: str) -> tuple[dict[str, _Computation], str, int]:
    comps: dict[str, _Computation] = {}
    entry = ""
    whiles: list[tuple[_Computation, str, str, str]] = []
    m = re.search(r"num_partitions=(\d+)", hlo)
    num_devices = int(m.group(1)) if m else 1
    for computation, is_entry, name, type_text, opcode, attrs in instructions(hlo):
        current = comps.setdefault(computation, _Computation([], [], []))
        entry = computation if is_entry else entry
        if opcode in KINDS:
            current.collectives.append((name, opcode, type_text, attrs))
        elif opcode.endswith("-start") and opcode[: -len("-start")] in KINDS:
            # Async forms (GPU) return a tuple holding operand and result: the buffer is the
            # largest array in it.
            arrays = [shape_bytes(f"{d}[{s}]") for d, s in _SHAPE.findall(type_text)]
            current.collectives.append(
                (name, opcode[: -len("-start")], f"u8[{max(arrays, default=0)}]", attrs)
            )
        elif opcode == "constant" and type_text.startswith(("s32[]", "s64[]", "u32[]")):
            current.constants.extend(_ints(attrs.split(")")[0]))
        callees = {
            key: re.findall(r"%?([\w.\-]+)", value) for key, value in _CALLEES.findall(attrs)
        }
        if opcode == "while":
            whiles.append((current, callees["body"][0], callees["condition"][0], attrs))
        elif opcode != "fusion":  # fused computations hold no collectives
            keys = ("to_apply",) if opcode == "call" else ("calls", "branch_computations")
            current.calls.extend((c, 1) for key in keys for c in callees.get(key, []))
    for caller, body, cond, attrs in whiles:
        caller.calls.append((body, _trip_count(attrs, comps.get(cond))))
    return comps, entry, num_devices


def collectives(hlo: str) -> list[Collective]:
    """Every collective in an optimised HLO module's text, with its executions per step."""
    comps, entry, num_devices = _parse(hlo)
    counts: dict[str, int] = collections.Counter()

    def visit(name: str, times: int) -> None:
        counts[name] += times
        for callee, factor in comps[name].calls if name in comps else []:
            visit(callee, times * factor)

    visit(entry, 1)
    found = []
    for cname, times in counts.items():
        for name, kind, type_text, attrs in comps[cname].collectives if cname in comps else []:
            if kind == "collective-permute":
                groups = _pairs(attrs)
                size = 2 if groups else 1
            else:
                groups = replica_groups(attrs, num_devices)
                size = len(groups[0]) if groups else num_devices
            payload = shape_bytes(type_text)
            if kind == "reduce-scatter":
                payload *= size  # the result is one shard of the reduced operand
            found.append(Collective(kind, payload, size, groups, times, name))
    return found


def bytes_by_kind(ops: list[Collective]) -> dict[str, float]:
    """Per-device bytes per step of each collective kind (ring model)."""
    totals = dict.fromkeys(KINDS, 0.0)
    for op in ops:
        totals[op.kind] += op.bytes_per_device
    return totals


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
