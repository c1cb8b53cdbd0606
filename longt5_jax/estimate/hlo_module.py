"""Optimised HLO text as data: its computations and instructions, array types and their bytes,
and how often each scheduled computation runs per step (a while loop's body once per iteration:
XLA's `known_trip_count`, or the bound its condition compares with; peeled loops counted).
`estimate/hlo.py` reads the collectives and memory of a compiled step from it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import numpy as np

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


def shape_bytes(type_text: str) -> int:
    """Bytes of an HLO type: an array `f32[4,8]{1,0}` or a tuple of them."""
    total = 0
    for dtype, dims in _SHAPE.findall(type_text):
        if dtype not in _DTYPE_BYTES and not dtype.startswith("f8"):
            continue  # token[] and the like carry no data
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * _DTYPE_BYTES.get(dtype, 1)
    return total


def largest_array_bytes(type_text: str) -> int:
    """Bytes of the largest array in a type (a tuple's or an array's own)."""
    return max((shape_bytes(f"{d}[{s}]") for d, s in _SHAPE.findall(type_text)), default=0)


# An array type with its layout; `S(5)` in the layout is XLA's host memory space.
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?\[[\d,]*\])(\{[^}]*\})?")
HOST_SPACE = "S(5)"


def arrays(type_text: str) -> list[tuple[int, bool]]:
    """(bytes, in host memory) of each array of a type, in order (a tuple's elements)."""
    return [
        (shape_bytes(shape), HOST_SPACE in (layout or ""))
        for shape, layout in _ARRAY.findall(type_text)
    ]


def tuple_elements(type_text: str) -> list[str]:
    """The top-level elements of a tuple type (an array type: itself alone)."""
    if not type_text.startswith("("):
        return [type_text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(type_text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if (ch == "," and depth == 1) or depth == 0:
            parts.append(type_text[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return parts


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

    def counted_from(self, root: str, skip: frozenset[str] = frozenset()) -> Module:
        """The program as if `root` were its entry (run once), not entering the computations
        in `skip`: a loop body's work per iteration, or a program's without one of its loops."""
        module = dataclasses.replace(self, entry=root, executions={})
        module._count(root, 1, skip)
        return module

    def callees(self, instr: Instr) -> dict[str, list[str]]:
        """The computations `instr` calls, by role (`body`, `condition`, `calls`, ...)."""
        return {k: re.findall(r"%?([\w.\-]+)", v) for k, v in _CALLEES.findall(instr.attrs)}

    def _count(self, name: str, times: int, skip: frozenset[str] = frozenset()) -> None:
        if name not in self.computations or name in skip:
            return
        self.executions[name] = self.executions.get(name, 0) + times
        for instr in self.computations[name].instrs:
            keys = _CONTROL.get(instr.opcode, ())
            callees = {k: re.findall(r"%?([\w.\-]+)", v) for k, v in _CALLEES.findall(instr.attrs)}
            factor = self._trip_count(instr, callees) if instr.opcode == "while" else 1
            for key in keys:
                for callee in callees.get(key, []):
                    self._count(callee, times * factor, skip)

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
        known = [c for c in consts if c is not None]
        return known[0] if len(known) == 1 else 1

    def _counted_loop(self, instr: Instr, cond: Computation) -> int | None:
        """`i < bound` (or <=) on tuple element k, k starting at a constant: the trip count."""
        compare = cond.root
        where: Computation | None = cond
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

    def loop_bodies(self) -> dict[str, bool]:
        """Whether each scheduled computation runs inside some while loop's body."""
        inside = dict.fromkeys(self.executions, False)

        def mark(name: str, flag: bool) -> None:
            if name not in self.computations or (inside.get(name) and flag):
                return
            inside[name] = inside.get(name, False) or flag
            for instr in self.computations[name].instrs:
                callees = {
                    k: re.findall(r"%?([\w.\-]+)", v) for k, v in _CALLEES.findall(instr.attrs)
                }
                for key in _CONTROL.get(instr.opcode, ()):
                    for callee in callees.get(key, []):
                        mark(callee, flag or (instr.opcode == "while" and key == "body"))

        mark(self.entry, False)
        return inside
