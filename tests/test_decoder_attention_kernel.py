"""The decoder's fused attention (Pallas, interpreted on CPU) against the XLA path it replaces,
and its launch settings as a GPU compiles them."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOLERANCE

from longt5_jax import kernel_checks
from longt5_jax.estimate import targets
from longt5_jax.kernels import launch as kernel_launch
from longt5_jax.kernels.interface import decoder_attention
from longt5_jax.model import LongT5Config
from longt5_jax.model.attention import Attention
from longt5_jax.model.layers import Rows


class _DecoderAttention(nn.Module):
    """The decoder's attention as a layer uses it: keys and values projected from `source`
    (with the config's dropout, the masks of `rows`)."""

    config: LongT5Config

    @nn.compact
    def __call__(self, x, source, mask, bias, rows=None):
        attention = Attention(self.config, not self.config.dropout_rate, name="attention")
        return attention(x, *attention.keys_values(source), mask, bias, rows)


# name: (batch, queries, keys, heads, self-attention, packed)
DECODER_CASES = {
    "self_causal_bias": (2, 21, 21, 3, True, False),
    "self_packed": (2, 19, 19, 2, True, True),
    "cross": (2, 7, 45, 4, False, False),
    "cross_packed": (3, 18, 70, 2, False, True),
    "self_two_tiles": (2, 70, 70, 2, True, False),  # two key tiles of 64 (the last padded)
}
# The decoder's forward and dq with each query tile's keys split in two programs (`Tiles.split`;
# cross-attention only, where the keys outnumber the queries).
KEY_SPLIT = (("decoder_attention_fwd", 4, 2, 2), ("decoder_attention_dq", 8, 2, 2))


@pytest.mark.parametrize(
    "case, launch, dropout",
    [pytest.param(case, (), 0.0, id=case) for case in sorted(DECODER_CASES)]
    + [
        pytest.param("cross_packed", KEY_SPLIT, 0.0, id="cross_packed-split"),
        pytest.param("cross_packed", KEY_SPLIT, 0.3, id="cross_packed-split-dropout"),
    ],
)
def test_fused_decoder_attention_matches_the_xla_path(case, launch, dropout):
    """Outputs and every gradient as the XLA path's; split, each query tile's keys in two
    programs whose outputs are combined by their log-sum-exps (a packed cross-attention's part
    may see none of a query's keys, and count for nothing), with dropout's masks too."""
    b, t, s, heads, self_attention, packed = DECODER_CASES[case]
    rng = np.random.default_rng(2)
    xla = LongT5Config.preset("tiny", num_heads=heads, dropout_rate=dropout)
    x = jnp.asarray(rng.normal(size=(b, t, xla.d_model)), jnp.float32)
    source = x if self_attention else jnp.asarray(rng.normal(size=(b, s, xla.d_model)), jnp.float32)
    q_seg, _ = kernel_checks.rows(b, t, packed, rng)
    k_seg = q_seg if self_attention else kernel_checks.rows(b, s, packed, rng)[0]
    mask = k_seg[:, None, :] > 0
    if packed:
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])
    if self_attention:
        mask = mask & (np.arange(s)[None, :] <= np.arange(t)[:, None])
    bias = jnp.asarray(rng.normal(size=(heads, t, s)), jnp.float32) if self_attention else None
    layer = _DecoderAttention(dataclasses.replace(xla, dropout_rate=0.0))  # the same parameters
    params = jax.jit(layer.init)(jax.random.key(0), x, source, mask, bias)["params"]
    params = jax.tree.map(lambda a: a * (1 + 0.3 * rng.normal(size=a.shape)), params)
    real = jnp.asarray(mask.any(-1))[..., None]  # rows that see no key are don't-care
    cotangent = jnp.asarray(rng.normal(size=x.shape), jnp.float32) * real

    rows = Rows(jnp.asarray([5, 2, 7][:b], jnp.int32), jnp.asarray(3)) if dropout else None
    drops = {"rngs": {"dropout": jax.random.key(4)}} if dropout else {}

    def run(config):
        def loss(params, x, source, bias):
            out = _DecoderAttention(config).apply(
                {"params": params}, x, source, mask, bias, rows, **drops
            )
            return jnp.sum(out * cotangent), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(
            params, x, source, bias
        )
        return out, grads

    want = run(xla)
    with kernel_launch.launch(launch):
        got = run(dataclasses.replace(xla, attention_kernel="pallas"))
    errors = kernel_checks.relative_errors(got, want, real)
    assert len(errors) == (8 if self_attention else 7)  # output, q/k/v/o, x, source (, bias)
    assert max(errors.values()) <= TOLERANCE, errors
    if dropout:  # it did drop out
        plain = run(dataclasses.replace(xla, dropout_rate=0.0))[0]
        assert float(jnp.max(jnp.abs(plain - want[0]))) > 0.1


def _lowered_for_a_gpu(launch, q, mask, keys=None) -> str:
    """The decoder attention's gradient of q (keys and values q, or `keys`), traced under
    `launch` and lowered for a GPU: the Triton calls' settings and grids as text."""
    with kernel_launch.launch(launch):

        def loss(q):
            k = q if keys is None else keys
            return decoder_attention(q, k, k, mask).astype(jnp.float32).sum()

        with targets.tracing_for(targets.devices(targets.load("h100-80gb"), 1, 1)):
            traced = jax.jit(jax.grad(loss)).trace(q)
            return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
def test_launch_settings_reach_the_triton_calls():
    """`launch.launch` sets each kernel's warps and stages by name (first match wins, the
    rest keep `LAUNCH`'s), in the Triton call a GPU compiles."""
    q = jnp.zeros((1, 64, 2, 16), jnp.bfloat16)
    mask = jnp.ones((1, 64, 64), bool)

    def lowered(launch):
        return re.findall(r'name = "(decoder_attention_\w+)\.flops.*?num_stages = (\d+) : i32, '
                          r"num_warps = (\d+)", _lowered_for_a_gpu(launch, q, mask))  # fmt: skip

    found = dict((name, (int(w), int(s))) for name, s, w in lowered(()))
    assert found == {"decoder_attention_fwd": (4, 2), "decoder_attention_dq": (8, 2),
                     "decoder_attention_dkv": (4, 2)}  # fmt: skip
    found = dict((name, (int(w), int(s))) for name, s, w in lowered((("*_dq", 2, 1),)))
    assert found["decoder_attention_dq"] == (2, 1) and found["decoder_attention_fwd"] == (4, 2)


@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
def test_a_key_split_reaches_the_triton_grid():
    """The decoder's forward split in 4 runs 4 programs a query tile in the Triton call a GPU
    compiles; a split that does not divide the key tiles (8 of 4) is not made, nor one of a
    self-attention (as many keys as queries)."""
    q, k = jnp.zeros((1, 64, 2, 16), jnp.bfloat16), jnp.zeros((1, 256, 2, 16), jnp.bfloat16)
    mask = jnp.ones((1, 1, 256), bool)

    def grids(launch):
        text = _lowered_for_a_gpu(launch, q, mask, keys=k)
        return [int(z) for z in re.findall(r"grid_z = (\d+) : i32", text)]

    split = (("decoder_attention_fwd", 4, 2, 4), ("decoder_attention_dq", 8, 2, 2))
    assert grids(()) == [1, 1]  # forward and dq (q's gradient only) over one query tile
    assert grids(split) == [4, 2]
    assert grids((("decoder_attention_*", 8, 2, 8),)) == [1, 1]
    self_mask = jnp.ones((1, 256, 256), bool)  # keys as many as queries: k as q

    def self_grids(launch):
        return re.findall(r"grid_z = (\d+) : i32", _lowered_for_a_gpu(launch, k, self_mask))

    assert self_grids(split) == self_grids(()) == ["4"] * 3  # fwd, dq, dkv: 4 tiles each
