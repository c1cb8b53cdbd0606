"""The reference harness every kernel is checked with: one attention layer of the model as a
problem (random parameters, tables and inputs, padded or packed rows), its loss and gradients
with either attention (`attention_kernel` "xla", the reference, or "pallas"), and the errors of
one against the other. The kernel tests, `bench kernels`, `bench headroom` and `bench sass` take
their layers from here.

A case is MODEL:tglobal|local|decoder:LENGTH:BATCH:padded|packed: the encoder's
`LongSelfAttention` (tglobal or local), or the decoder's causal self-attention (TARGETS targets,
or LENGTH if fewer, with its bias) followed by cross-attention over LENGTH encoder tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from longt5_jax.errors import UsageError
from longt5_jax.kernels import launch as launches
from longt5_jax.model import LongT5Config
from longt5_jax.model.attention import Attention
from longt5_jax.model.long_attention import LongSelfAttention, global_blocks, local_bias

TARGETS = 512  # the decoder's queries in a `decoder` case


def parse_case(text: str) -> tuple[str, str, int, int, bool]:
    parts = text.split(":")
    ok = len(parts) == 5 and parts[2].isdigit() and parts[3].isdigit()
    ok = ok and parts[1] in ("tglobal", "local", "decoder") and parts[4] in ("padded", "packed")
    if not ok:
        raise UsageError(
            f"--cases {text!r}: expected MODEL:tglobal|local|decoder:LENGTH:BATCH:padded|packed"
        )
    return parts[0], parts[1], int(parts[2]), int(parts[3]), parts[4] == "packed"


def rows(batch: int, length: int, packed: bool, rng) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions): the first row full, the others padded to random lengths; packed
    rows hold up to four segments."""
    seg = np.zeros((batch, length), np.int32)
    pos = np.zeros((batch, length), np.int32)
    for b in range(batch):
        end = int(rng.integers(length // 2, length + 1)) if b else length
        bounds = [0, end]
        if packed:
            cuts = rng.choice(np.arange(1, end), size=min(3, end - 1), replace=False)
            bounds = [0, *np.sort(cuts).tolist(), end]
        for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            seg[b, lo:hi] = s + 1
            pos[b, lo:hi] = np.arange(hi - lo)
    return seg, pos


def _perturbed(params, seed: int):
    """Parameters perturbed in proportion to each one's spread: an absolute perturbation at
    d_model 768 makes logits of hundreds, a one-hot softmax and q, k gradients that are zero up
    to rounding."""
    noise = jax.random.key(seed + 1)
    return jax.tree.map(
        lambda a: a
        + 0.3 * jnp.where(a.std() > 0, a.std(), 1.0) * jax.random.normal(noise, a.shape),
        params,
    )


class Problem(NamedTuple):
    """A layer's parameters, its inputs by name and its output's cotangent."""

    params: Any
    inputs: dict[str, Any]
    cotangent: jax.Array


def layer_problem(config, batch: int, length: int, packed: bool, seed: int = 0) -> Problem:
    """(params, inputs, cotangent) of one encoder attention layer: random parameters, tables and
    input."""
    rng = np.random.default_rng(seed)
    seg, pos = rows(batch, length, packed, rng)
    tglobal = config.attention == "transient-global"
    h, r = config.num_heads, config.relpos_buckets
    x = jnp.asarray(rng.normal(size=(batch, length, config.d_model)), jnp.float32)
    inputs = {
        "x": x,
        "seg": jnp.asarray(seg),
        "blocks": global_blocks(jnp.asarray(seg), jnp.asarray(pos), config.global_block_size)
        if tglobal
        else None,
        "local_table": jnp.asarray(rng.normal(size=(h, r)), jnp.float32),
        "side_table": jnp.asarray(rng.normal(size=(h, r)), jnp.float32) if tglobal else None,
    }
    w = config.block_len
    layer = LongSelfAttention(config, True)
    params = layer.init(
        jax.random.key(seed), inputs["x"], segment_ids=inputs["seg"],
        local_bias_HWX=jnp.zeros((h, w, 3 * w)), blocks=inputs["blocks"],
        side_table_HR=inputs["side_table"],
    )  # fmt: skip
    params = nn.unbox(params)["params"]
    real = jnp.asarray(seg > 0)[..., None]
    cotangent = jnp.asarray(rng.normal(size=x.shape), jnp.float32) * real
    return Problem(_perturbed(params, seed), inputs, cotangent)


def _decoder_attention(config):
    """A decoder layer's attention: causal self-attention with its bias, then cross-attention."""

    class DecoderAttention(nn.Module):
        @nn.compact
        def __call__(self, y, encoded, self_mask, bias, cross_mask):
            attend = Attention(config, True, name="self_attention")
            k, v = attend.keys_values(y)
            y = y + attend(y, k, v, mask_BTS=self_mask, bias_HTS=bias)
            cross = Attention(config, True, name="encoder_decoder_attention")
            k, v = cross.keys_values(encoded)
            return y + cross(y, k, v, mask_BTS=cross_mask)

    return DecoderAttention()


def decoder_problem(config, batch: int, length: int, packed: bool, seed: int = 0) -> Problem:
    """(params, inputs, cotangent) of a decoder layer's attention over `length` encoder tokens
    (padded or packed) from TARGETS queries, or `length` if fewer (all real; causal)."""
    rng = np.random.default_rng(seed)
    seg, _ = rows(batch, length, packed, rng)
    d, h, t = config.d_model, config.num_heads, min(TARGETS, length)
    causal = np.tril(np.ones((t, t), bool))[None]
    inputs = {
        "x": jnp.asarray(rng.normal(size=(batch, t, d)), jnp.float32),
        "encoded": jnp.asarray(rng.normal(size=(batch, length, d)), jnp.float32),
        "self_mask": jnp.asarray(causal),
        "bias": jnp.asarray(rng.normal(size=(h, t, t)), jnp.float32),
        "cross_mask": jnp.asarray(seg > 0)[:, None, :],
        "seg": jnp.ones((batch, t), jnp.int32),
    }
    layer = _decoder_attention(config)
    named = ("encoded", "self_mask", "bias", "cross_mask")
    params = layer.init(jax.random.key(seed), inputs["x"], **{k: inputs[k] for k in named})
    params = params["params"]
    cotangent = jnp.asarray(rng.normal(size=inputs["x"].shape), jnp.float32)
    return Problem(_perturbed(params, seed), inputs, cotangent)


@functools.cache
def layer_loss_grad(config, kind: str, launch: tuple = ()):
    """Jitted (params, inputs, cotangent, x) -> ((loss, output), gradients of the parameters,
    x and the float inputs) of an encoder or decoder (`kind`) layer, its kernels launched with
    `launch`: a function of its own per setting, traced inside it (the setting is no part of
    jit's cache key: one function would run the first setting's program for every one)."""
    if kind == "decoder":
        layer = _decoder_attention(config)

        def apply(params, x, inputs):
            return layer.apply(
                {"params": params}, x, encoded=inputs["encoded"], self_mask=inputs["self_mask"],
                bias=inputs["bias"], cross_mask=inputs["cross_mask"],
            )  # fmt: skip

        wrt = ("encoded", "bias")
    else:
        layer = LongSelfAttention(config, True)

        def apply(params, x, inputs):
            return layer.apply(
                {"params": params}, x, segment_ids=inputs["seg"],
                local_bias_HWX=local_bias(config, inputs["local_table"]),
                blocks=inputs["blocks"], side_table_HR=inputs["side_table"],
            )  # fmt: skip

        wrt = ("local_table", "side_table")

    def loss(params, x, tables, inputs, cotangent):
        out = apply(params, x, {**inputs, **tables})
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

    def run(params, inputs, cotangent, x):
        with launches.launch(launch):
            tables = {k: inputs[k] for k in wrt}
            return grad(params, x, tables, inputs=inputs, cotangent=cotangent)

    return jax.jit(run)


def run_layer(config, params, inputs, cotangent, dtype="float32", launch=()):
    """(output, gradients) of the layer of `inputs` (a decoder's if they hold `encoded`) with
    `config` in `dtype` (inputs cast to it)."""
    config, kind, inputs = in_dtype(config, inputs, dtype)
    step = layer_loss_grad(config, kind, launch)
    (_, out), grads = step(params, inputs, cotangent, inputs["x"])
    return jax.block_until_ready((out, grads))


def in_dtype(config, inputs, dtype: str):
    """(config, kind, inputs) of a layer computing in `dtype`, its float inputs cast to it; kind
    is "decoder" where the inputs hold `encoded`."""
    kind = "decoder" if "encoded" in inputs else "encoder"
    cast = ("x", "encoded") if kind == "decoder" else ("x",)
    inputs = {**inputs, **{k: inputs[k].astype(jnp.dtype(dtype)) for k in cast}}
    return dataclasses.replace(config, dtype=dtype), kind, inputs


def case_problem(case: str) -> tuple[LongT5Config, Problem]:
    """(the XLA path's config, (params, inputs, cotangent)) of a case of `CASES`' form."""
    model, kind, length, batch, packed = parse_case(case)
    config = LongT5Config.preset(model, "local" if kind == "decoder" else kind)
    build = decoder_problem if kind == "decoder" else layer_problem
    return config, build(config, batch, length, packed)


def relative_errors(got, want, real) -> dict[str, float]:
    """Largest |got - want| over the largest |want|, for the output (real rows) and each
    gradient, by key path; inf where either is not finite (a NaN passes any tolerance)."""

    def err(g, w):
        g, w = jnp.asarray(g, jnp.float32), jnp.asarray(w, jnp.float32)
        if not (jnp.isfinite(g).all() and jnp.isfinite(w).all()):
            return float("inf")
        scale = float(jnp.max(jnp.abs(w)))
        return float(jnp.max(jnp.abs(g - w))) / scale if scale else float(jnp.max(jnp.abs(g)))

    out = {"output": err(got[0] * real, want[0] * real)}
    flat, _ = jax.tree.flatten_with_path(want[1])
    for (path, w), g in zip(flat, jax.tree.leaves(got[1]), strict=True):
        out["grad" + jax.tree_util.keystr(path)] = err(g, w)
    return out
