"""What decoding moves in a GPU's memory, read from its deviceless compile, against the least.

Decoding is memory-bound on a GPU: a step (one token for every row) does little arithmetic per
byte, so the bytes its kernels read and write decide its time. A step must read, at least once,
the decoder's weights, its self-attention cache and each document's cross-attention keys and
values (`bound`). The program compiled is the one `infer.decode.generate` runs: the prefill (the
encoder, with the fused attention kernels where the target runs them, and the first decoder
step, which fills the cross-attention cache) and the token loop, whose body is one step
(`measured`). A step that copies a cache it only appends to, rewrites the keys it only reads, or
reads a document's keys once a beam shows here as bytes over the bound.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from longt5_jax.estimate import compile_ahead, hlo_module, roofline, targets
from longt5_jax.infer import decode
from longt5_jax.model import LongT5, LongT5Config, abstract_params
from longt5_jax.parallel.sharding import for_devices


@dataclasses.dataclass(frozen=True)
class Bound:
    """The bytes a decode step must read: each once, in the dtype the step computes with."""

    weights: int  # the decoder's layers (compute dtype), its output projection (float32)
    self_cache: int  # every layer's self-attention keys and values, all positions, every row
    cross: int  # every layer's cross-attention keys and values, once a document

    @property
    def total(self) -> int:
        return self.weights + self.self_cache + self.cross


@dataclasses.dataclass(frozen=True)
class DecodeBytes:
    """HBM bytes of one `generate` call at a batch and beam count, and its step's bound."""

    batch: int
    beams: int
    prefill: float  # everything outside the token loop, once a call
    step: float  # one iteration of the token loop: a token for each of batch x beams rows
    bound: Bound

    @property
    def per_token(self) -> float:
        return self.step / (self.batch * self.beams)

    @property
    def over_bound(self) -> float:
        return self.step / self.bound.total


def bound(
    config: LongT5Config, batch: int, beams: int, input_length: int, max_length: int
) -> Bound:
    """The least a step reads: the decoder's parameters (the layers' in the compute dtype, which
    the prefill can cast them to once; the rest as stored: the output projection runs in
    float32), one embedding row per decoder row, the self-attention cache of `max_length`
    positions for batch x beams rows, and the cross-attention keys and values of `batch`
    documents of `input_length` tokens."""
    half = jnp.dtype(config.compute_dtype).itemsize
    decoder = dict(nn.unbox(abstract_params(LongT5(config)))["decoder"])
    layers = sum(x.size for x in jax.tree.leaves(decoder.pop("layers")))
    rest = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(decoder))
    rows = batch * beams
    embedding = rows * config.d_model * 4
    heads = config.num_decoder_layers * 2 * config.num_heads * config.d_kv * half
    return Bound(
        weights=layers * half + rest + embedding,
        self_cache=heads * rows * max_length,
        cross=heads * batch * input_length,
    )


def _token_loop(module: hlo_module.Module) -> tuple[str, str]:
    """(body, condition) of the program's token loop."""
    for comp, _ in module.scheduled():
        for instr in comp.instrs:
            if instr.opcode == "while" and f"/{decode.LOOP}/" in roofline.op_name(instr):
                called = module.callees(instr)
                return called["body"][0], called["condition"][0]
    raise ValueError(f"no while loop named {decode.LOOP!r} in the compiled program")


def measured(
    config: LongT5Config,
    target: targets.Target,
    batch: int,
    beams: int,
    input_length: int,
    max_length: int,
) -> DecodeBytes:
    """`generate`'s bytes, compiled without the GPU for one device of `target`."""
    device = targets.devices(target, 1, 1)[0]
    model = for_devices(LongT5(config), Mesh(np.asarray([device]), ("data",)))
    cfg = decode.DecodeConfig(num_beams=beams)
    params = nn.unbox(abstract_params(LongT5(config)))
    ids = jax.ShapeDtypeStruct((batch, input_length), jnp.int32)
    rng = jax.eval_shape(functools.partial(jax.random.key, 0))

    @jax.jit
    def run(params, ids, mask, rng):
        return decode.generate(model, params, ids, mask, cfg, max_length, rng)

    executable = compile_ahead.compile_on_one(run, [params, ids, ids, rng], target)
    module = hlo_module.Module.parse(executable.as_text())
    body, condition = _token_loop(module)
    step = sum(roofline.roofline(module.counted_from(c), 1.0, 1.0).bytes for c in (body, condition))
    prefill = roofline.roofline(
        module.counted_from(module.entry, frozenset({body, condition})), 1.0, 1.0
    ).bytes
    return DecodeBytes(
        batch, beams, prefill, step, bound(config, batch, beams, input_length, max_length)
    )
