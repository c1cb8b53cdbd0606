"""A roofline over a compiled program: each kernel's time bounded below by its arithmetic and its
memory traffic, summed over the kernels a step launches.

    kernel seconds = max(FLOPs / peak, bytes / HBM bandwidth)

Kernels are the scheduled instructions of the optimised HLO (fusions, library calls, standalone
copies and the like), each counted as often as its loops run. FLOPs are those of the dots and
convolutions inside (2 per multiply-add; elementwise arithmetic is negligible beside memory on a
GPU and is left out). Bytes are what the kernel reads and writes in HBM: its operands and result,
except that an operand the kernel only slices is charged for the slices, and a result written by
an in-place dynamic-update-slice is charged for the update. Float32 dots run at half the bf16
peak (TF32 tensor cores). A Pallas Triton kernel (a custom call XLA cannot see into) is charged
its operands and results, and the FLOPs it declares in its name: `<kernel>.flops_<N>`, N the
bf16-rate FLOPs of one call (its `pallas_call(name=...)`, which the HLO keeps; a cost estimate
does not survive lowering). Collectives are communication, charged elsewhere. The sum is what a
perfect scheduler on one stream reaches: no overlap between kernels, no launch overhead.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

from longt5_jax.estimate.hlo import KINDS
from longt5_jax.estimate.hlo_module import (
    Computation,
    Instr,
    Module,
    dims,
    shape_bytes,
    tuple_elements,
)

# Instructions that launch no kernel: bookkeeping, control flow (their bodies are counted as
# computations of their own), and the second half of asynchronous pairs.
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
    "conditional", "after-all", "partition-id", "replica-id", "opt-barrier", "async-start",
    "async-update", "async-done", "copy-done", "send-done", "recv-done", "add-dependency",
}  # fmt: skip
_SLICES = {"dynamic-slice", "slice", "gather"}
# jax 0.12's XLA runs some loop fusions (a scanned layer's slices of its stacked parameters,
# its in-place updates of stacked results) on a stream of their own: a `fusion-start`, the
# kernel, and a `fusion-done` that waits for it.
_FUSIONS = {"fusion", "fusion-start"}
# A dot's contracted lhs dims: in its attributes, or a cuBLAS call's backend config.
_CONTRACTING = re.compile(
    r'lhs_contracting_dims=\{([\d,]*)\}|"lhs_contracting_dimensions":\[([^\]]*)\]'
)
TRITON = 'custom_call_target="__gpu$xla.gpu.triton"'
_KERNEL_NAME = re.compile(r'\bname = "([^"]*)"')  # a Triton call's backend config
_OP_NAME = re.compile(r'op_name="([^"]*)"')
DECLARED_FLOPS = re.compile(r"\.flops_(\d+)")
# What a kernel is, for a step's time by kind: a Pallas call (the fused attention kernels, at the
# FLOPs they declare), a matmul (a fusion or library call with dots), or the rest (elementwise,
# reductions, copies: memory-bound). `bench profile` sorts the GPU's timeline into the same three.
KINDS_OF_KERNEL = ("pallas", "matmul", "other")


@dataclasses.dataclass
class Roofline:
    flops: float = 0.0  # executed dot FLOPs per step
    bytes: float = 0.0  # HBM bytes read and written per step
    seconds: float = 0.0  # sum over kernels of max(compute, memory)
    compute_bound_seconds: float = 0.0  # the part spent in kernels whose arithmetic bounds them
    kernels: int = 0  # kernel launches per step

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _dot_flops(comp: Computation, instr: Instr) -> float:
    """2 x output elements x contracted size; the contracted dims are read off the lhs."""
    lhs = dims(comp.types.get(instr.operands[0], "")) if instr.operands else ()
    out = int(np.prod(dims(instr.type)))
    if instr.opcode == "convolution":
        rhs = dims(comp.types.get(instr.operands[1], ""))
        return 2.0 * out * int(np.prod(rhs)) / max(rhs[-1], 1) if rhs else 0.0
    m = _CONTRACTING.search(instr.attrs)
    contracted = [int(d) for d in re.findall(r"\d+", (m.group(1) or m.group(2)) if m else "")]
    return 2.0 * out * int(np.prod([lhs[d] for d in contracted if d < len(lhs)]))


def _is_matmul(instr: Instr) -> bool:
    """A dot, a convolution, or a library GEMM (cuBLAS custom call)."""
    if instr.opcode in ("dot", "convolution"):
        return bool(instr.operands)
    return instr.opcode == "custom-call" and "gemm" in instr.attrs.split(",", 1)[0] + instr.attrs


def _is_f32(type_text: str) -> bool:
    return type_text.startswith("f32")


def _fused_flops(module: Module, comp: Computation) -> tuple[float, float]:
    """(bf16-rate FLOPs, f32-rate FLOPs) of the dots in a fused computation and its nests."""
    fast = slow = 0.0
    for instr in comp.instrs:
        if instr.opcode in ("dot", "convolution"):
            f = _dot_flops(comp, instr)
            operand = comp.types.get(instr.operands[0], "")
            fast, slow = (fast, slow + f) if _is_f32(operand) else (fast + f, slow)
        elif instr.opcode == "fusion":
            inner = module.computations.get(_callee(instr))
            if inner is not None:
                a, b = _fused_flops(module, inner)
                fast, slow = fast + a, slow + b
    return fast, slow


def _callee(instr: Instr) -> str:
    text = instr.attrs.split("calls=", 1)
    return text[1].split(",", 1)[0].strip().lstrip("%") if len(text) > 1 else ""


def _result(instr: Instr) -> str:
    """The type a kernel writes: an asynchronous start's is (operands, result, context)."""
    if instr.opcode.endswith("-start"):
        parts = tuple_elements(instr.type)
        return parts[1] if len(parts) == 3 else instr.type
    return instr.type


def _uses(fused: Computation, name: str) -> list[tuple[str, Instr]]:
    """The instructions reading `name`, directly or through bitcasts (which move no data; XLA
    puts one between a stacked buffer in a transposed layout and its slices), each with the
    name it reads."""
    out = []
    for user in fused.users(name):
        out += _uses(fused, user.name) if user.opcode == "bitcast" else [(name, user)]
    return out


def _fusion_bytes(module: Module, comp: Computation, instr: Instr) -> float:
    """Operands read (slices where only sliced) and the result written (updates where in place)."""
    fused = module.computations.get(_callee(instr))
    if fused is None:
        return _plain_bytes(comp, instr)
    params = {i.name: int(i.args) for i in fused.instrs if i.opcode == "parameter"}
    read = {}
    for name, index in params.items():
        uses = _uses(fused, name)
        full = (
            shape_bytes(comp.types.get(instr.operands[index], ""))
            if index < len(instr.operands)
            else 0
        )
        if uses and all(u.opcode in _SLICES and u.operands[0] == via for via, u in uses):
            read[name] = min(full, sum(shape_bytes(u.type) for _, u in uses))
        else:
            read[name] = full
    written = shape_bytes(_result(instr))
    root, by_name = fused.root, {i.name: i for i in fused.instrs}
    updates = [root] if root.opcode == "dynamic-update-slice" else []
    if root.opcode == "tuple":
        updates = [
            by_name[o]
            for o in root.operands
            if by_name.get(o, root).opcode == "dynamic-update-slice"
        ]
    for dus in updates:  # in place: the buffer is neither read nor rewritten, only the update
        buffer, update = dus.operands[0], dus.operands[1]
        written -= shape_bytes(dus.type) - shape_bytes(fused.types.get(update, ""))
        while buffer in by_name and by_name[buffer].opcode == "bitcast":
            buffer = by_name[buffer].operands[0]
        if buffer in read:
            read[buffer] = 0
    return float(sum(read.values()) + max(written, 0))


def _plain_bytes(comp: Computation, instr: Instr) -> float:
    operands = sum(shape_bytes(comp.types.get(o, "")) for o in instr.operands)
    if instr.opcode in _SLICES:
        operands = shape_bytes(instr.type) + sum(
            shape_bytes(comp.types.get(o, "")) for o in instr.operands[1:]
        )
    if instr.opcode == "dynamic-update-slice":
        update = (
            shape_bytes(comp.types.get(instr.operands[1], "")) if len(instr.operands) > 1 else 0
        )
        return 2.0 * update
    return float(operands + shape_bytes(instr.type))


@dataclasses.dataclass(frozen=True)
class Kernel:
    fast_flops: float  # at the bf16 peak
    slow_flops: float  # float32 dots, at half of it
    bytes: float

    def seconds(self, peak_flops: float, hbm_bytes_per_s: float) -> tuple[float, float]:
        """(arithmetic, memory) seconds."""
        compute = self.fast_flops / peak_flops + self.slow_flops / (peak_flops / 2)
        return compute, self.bytes / hbm_bytes_per_s


def op_name(instr: Instr) -> str:
    """The instruction's `op_name` metadata (the jax name stack), or ""."""
    m = _OP_NAME.search(instr.attrs)
    return m.group(1) if m else ""


def triton_name(instr: Instr) -> str:
    """The name a Pallas Triton call was given (`pallas_call(name=...)`), or ""."""
    names = _KERNEL_NAME.findall(instr.attrs)
    if names:
        return names[-1]
    parts = op_name(instr).split("/")  # .../NAME/pallas_call
    return parts[-2] if len(parts) > 1 and parts[-1] == "pallas_call" else ""


def _is_pallas(instr: Instr) -> bool:
    """A Pallas Triton call: a custom call XLA cannot see into."""
    return instr.opcode == "custom-call" and TRITON in instr.attrs


def declared_flops(instr: Instr) -> float:
    """The FLOPs a Pallas Triton kernel declares in its name (0 when it declares none)."""
    m = DECLARED_FLOPS.search(triton_name(instr))
    return float(m.group(1)) if m else 0.0


def kernel(module: Module, comp: Computation, instr: Instr) -> Kernel | None:
    """The work of one scheduled instruction, or None if it launches no kernel."""
    op = instr.opcode
    if op in _FREE or op.endswith("-done") or op.removesuffix("-start") in KINDS:
        return None
    if op in _FUSIONS:
        fused = module.computations.get(_callee(instr))
        fast, slow = _fused_flops(module, fused) if fused else (0.0, 0.0)
        return Kernel(fast, slow, _fusion_bytes(module, comp, instr))
    if _is_pallas(instr):
        return Kernel(declared_flops(instr), 0.0, _plain_bytes(comp, instr))
    fast = slow = 0.0
    if _is_matmul(instr):
        flops = _dot_flops(comp, instr)
        fast, slow = (
            (0.0, flops) if _is_f32(comp.types.get(instr.operands[0], "")) else (flops, 0.0)
        )
    return Kernel(fast, slow, _plain_bytes(comp, instr))


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """One scheduled kernel: its work per launch, and its launches per step."""

    name: str  # the HLO instruction
    opcode: str
    op_name: str  # the jax name stack it came from ("" if none)
    bytes: float
    fast_flops: float
    slow_flops: float
    compute_s: float
    memory_s: float
    times: int
    kind: str  # one of KINDS_OF_KERNEL

    @property
    def seconds(self) -> float:
        """Roofline seconds of one launch."""
        return max(self.compute_s, self.memory_s)


def kind_of(instr: Instr, k: Kernel) -> str:
    """Which of KINDS_OF_KERNEL a scheduled instruction's kernel `k` is."""
    if _is_pallas(instr):
        return "pallas"
    return "matmul" if k.fast_flops + k.slow_flops > 0 else "other"


def kernels(module: Module, peak_flops: float, hbm_bytes_per_s: float) -> list[KernelCost]:
    """Every kernel a step launches, in schedule order within each computation."""
    out = []
    for comp, times in module.scheduled():
        for instr in comp.instrs:
            k = kernel(module, comp, instr)
            if k is None:
                continue
            compute, memory = k.seconds(peak_flops, hbm_bytes_per_s)
            out.append(
                KernelCost(
                    instr.name,
                    instr.opcode,
                    op_name(instr),
                    k.bytes,
                    k.fast_flops,
                    k.slow_flops,
                    compute,
                    memory,
                    times,
                    kind_of(instr, k),
                )
            )
    return out


def by_kind(kernels: list[KernelCost]) -> dict[str, Roofline]:
    """The roofline of a step's kernels of each of KINDS_OF_KERNEL (all three, in that order)."""
    return {kind: total([k for k in kernels if k.kind == kind]) for kind in KINDS_OF_KERNEL}


def total(kernels: list[KernelCost]) -> Roofline:
    """The roofline of a step from its kernels."""
    out = Roofline()
    for k in kernels:
        out.flops += k.times * (k.fast_flops + k.slow_flops)
        out.bytes += k.times * k.bytes
        out.seconds += k.times * k.seconds
        out.compute_bound_seconds += k.times * k.compute_s * (k.compute_s >= k.memory_s)
        out.kernels += k.times
    return out


def roofline(module: Module, peak_flops: float, hbm_bytes_per_s: float) -> Roofline:
    """The roofline of a parsed program on a device of `peak_flops` (bf16) and HBM bandwidth."""
    return total(kernels(module, peak_flops, hbm_bytes_per_s))


def exposed_communication(
    module: Module,
    comm_seconds: dict[str, float],
    peak_flops: float,
    hbm_bytes_per_s: float,
) -> float:
    """Seconds per step the program waits on collectives, as XLA scheduled them.

    `comm_seconds` maps each collective's name to the duration of one execution. Collectives run
    one at a time in issue order (one NCCL stream); an asynchronous one progresses while the
    kernels scheduled between its start and its done run (at their roofline time), and what is
    left when the done is reached is waited for. A synchronous collective (no start/done pair,
    or one XLA marked `is_sync`) waits for everything before it and then for itself.
    """
    exposed = 0.0
    for comp, times in module.scheduled():
        queue: collections.deque[list] = collections.deque()
        waited = 0.0
        for instr in comp.instrs:
            kind = instr.opcode.removesuffix("-start")
            if instr.name in comm_seconds and kind in KINDS:
                duration = comm_seconds[instr.name]
                if instr.opcode == kind or '"is_sync":true' in instr.attrs:
                    waited += sum(r for _, r in queue) + duration
                    queue.clear()
                else:
                    queue.append([instr.name, duration])
            elif instr.opcode.endswith("-done") and instr.operands:
                started = instr.operands[0]
                while queue and started in (name for name, _ in queue):
                    name, remaining = queue.popleft()
                    waited += remaining
                    if name == started:
                        break
            else:
                k = kernel(module, comp, instr)
                busy = max(k.seconds(peak_flops, hbm_bytes_per_s)) if k else 0.0
                while busy > 0 and queue:
                    step = min(busy, queue[0][1])
                    queue[0][1] -= step
                    busy -= step
                    if queue[0][1] <= 0:
                        queue.popleft()
        waited += sum(r for _, r in queue)  # still running when the computation ends
        exposed += times * waited
    return exposed
