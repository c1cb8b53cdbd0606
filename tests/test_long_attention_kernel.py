"""The fused encoder attention (Pallas, interpreted on CPU) against the XLA path it replaces."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import TOLERANCE, assert_same_training, tiny_batches
from jax.extend.core import jaxprs_in_params
from jax.sharding import NamedSharding, PartitionSpec

from longt5_jax import kernel_checks
from longt5_jax.errors import ConfigError
from longt5_jax.estimate import compile_ahead, flops, hlo, targets
from longt5_jax.infer.decode import DecodeConfig
from longt5_jax.infer.generator import Generator
from longt5_jax.kernels import encoder_geometry
from longt5_jax.kernels import launch as kernel_launch
from longt5_jax.kernels.interface import fused
from longt5_jax.model import LongT5Config
from longt5_jax.model.layers import Rows
from longt5_jax.model.long_attention import LongSelfAttention, global_blocks, local_bias
from longt5_jax.model.transformer import LongT5
from longt5_jax.parallel.mesh import ParallelConfig, make_mesh
from longt5_jax.training.step import ShardedStep, StepConfig

# name: (attention, local radius, global block, batch, length, heads, packed). Lengths are not
# multiples of the block W = radius + 1 except where said; short_g0 is shorter than one global
# block (no side keys).
CASES = {
    "tglobal": ("transient-global", 3, 4, 2, 29, 4, False),
    "tglobal_packed": ("transient-global", 3, 2, 2, 32, 2, True),  # a multiple of W
    "tglobal_w8_packed": ("transient-global", 7, 3, 3, 45, 3, True),
    "local": ("local", 3, 4, 2, 21, 3, False),
    "local_packed": ("local", 7, 4, 1, 40, 4, True),
    "short_g0": ("transient-global", 3, 16, 2, 11, 2, False),
    # W = 32: local key blocks taken half at a time, as at the published sizes.
    "tglobal_w32_packed": ("transient-global", 31, 8, 1, 80, 2, True),
    "local_w32": ("local", 31, 4, 2, 70, 2, False),
    # 40 side keys: one chunk of 64 whole, two of 32 split.
    "tglobal_w32_g40": ("transient-global", 31, 2, 1, 80, 2, False),
    # W = 64 (key parts of 32) and 37 side keys (one chunk of 64), for KEYS.
    "tglobal_w64": ("transient-global", 63, 4, 1, 150, 2, False),
}
# TGlobal's forward and dq with each query block split into two programs (`Geometry.splits`),
# and Local's whole (each the other way from its default, `launch.LAUNCH`).
SPLIT = (("encoder_attention_fwd", 4, 3, 2), ("encoder_attention_dq", 4, 3, 2))
WHOLE = (("encoder_local_*", 8, 3),)
# Every TGlobal kernel taking 16 keys a tile (`Geometry.splits`), the forward's and dq's local
# keys in a loop (`encoder_tiles.local_keys`), split too; whole and looped at their own key
# parts (64 > W / 2 = 16 keys: not capped); Local's looped (W = 8: 8 keys a part).
KEYS = (
    ("encoder_attention_fwd", 4, 3, 2, 16),
    ("encoder_attention_dq", 4, 3, 2, 16),
    ("encoder_attention_*", 8, 3, 1, 16),
)
LOOPED = (("encoder_attention_fwd", 8, 2, 1, 64), ("encoder_attention_dq", 8, 2, 1, 64))
# `gpu_check.sh`'s first settings together: two programs of 8 warps an SM (ptxas, base 16k).
TWO_AN_SM = (
    ("encoder_attention_fwd", 8, 2, 1, 64),
    ("encoder_attention_dq", 8, 2, 1, 32),
    ("encoder_attention_dkv", 8, 3, 1, 32),
    ("encoder_attention_dbias", 8, 2, 1, 32),
)
LOOPED_LOCAL = (("encoder_local_*", 8, 3, 1, 16),)


@pytest.mark.parametrize(
    "case, launch",
    # Each at W = 32 the other way too; local_w32 whole in the slow pass only (tglobal_w32_packed
    # runs the same local key parts whole).
    [pytest.param(case, (), id=case) for case in sorted(CASES) if case != "tglobal_w64"]
    + [
        pytest.param("tglobal_w32_packed", SPLIT, id="tglobal_w32_packed-split"),
        pytest.param("tglobal_w32_g40", SPLIT, id="tglobal_w32_g40-split"),
        pytest.param("tglobal_w64", KEYS, id="tglobal_w64-keys16"),
        pytest.param("tglobal_w32_packed", LOOPED, id="tglobal_w32_packed-looped"),
        pytest.param("local_packed", LOOPED_LOCAL, id="local_packed-looped"),
        pytest.param("local_w32", WHOLE, id="local_w32-whole", marks=pytest.mark.slow),
    ],
)
def test_fused_attention_matches_the_xla_path(case, launch):
    """Outputs and every gradient as the XLA path's; split (Local's default, TGlobal with
    SPLIT), the forward and dq programs of half a query block each (W = 32: 16 rows), skipping
    the local keys beyond them."""
    attention, radius, k, batch, length, heads, packed = CASES[case]
    xla = LongT5Config.preset(
        "tiny", attention, local_radius=radius, global_block_size=k, num_heads=heads
    )
    params, inputs, cotangent = kernel_checks.layer_problem(xla, batch, length, packed)
    want = kernel_checks.run_layer(xla, params, inputs, cotangent)
    fused = dataclasses.replace(xla, attention_kernel="pallas")
    got = kernel_checks.run_layer(fused, params, inputs, cotangent, launch=launch)
    errors = kernel_checks.relative_errors(got, want, inputs["seg"][..., None] > 0)
    # Every gradient is there: both bias tables, the input, the projections (and side norm).
    assert len(errors) == (9 if attention == "transient-global" else 7)
    assert max(errors.values()) <= TOLERANCE, errors


def test_a_split_query_block_skips_only_keys_beyond_its_queries():
    """At the published W = 128 (key parts of 64): split in two, the second half of a query
    block is beyond (distance > 127) the first part of the block before, the first half beyond
    the last part of the block after, and nothing else; one local chunk in six is skipped.
    By default Local's forward and dq are split, TGlobal's not; a split program takes side
    keys 32 at a time."""
    q = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)
    whole = encoder_geometry.geometry(q, 128, 0, 16)
    fwd = whole.splits(whole.kernel("fwd"))
    assert (fwd.split, fwd.query_rows) == (2, 64)
    assert whole.splits(whole.kernel("dq")).split == 2
    assert whole.splits(whole.kernel("dkv")).split == 1
    tglobal = encoder_geometry.geometry(q, 128, 64, 16)
    assert tglobal.splits(tglobal.kernel("fwd")) == tglobal
    # Keys given: the local keys looped, capped to the key parts.
    with kernel_launch.launch(LOOPED):
        looped = tglobal.splits(tglobal.kernel("fwd"))
        assert (looped.looped, looped.key_chunk, looped.side_chunk) == (True, 64, 64)
        assert not tglobal.splits(tglobal.kernel("dkv")).looped
    with kernel_launch.launch(SPLIT):  # split, side keys 32 at a time (64 whole)
        halves = tglobal.splits(tglobal.kernel("fwd"))
        assert (halves.split, halves.side_chunk, tglobal.side_chunk) == (2, 32, 64)
    skipped = {chunk: fwd.beyond(*chunk) for chunk in fwd.local_chunks if fwd.beyond(*chunk)}
    assert skipped == {(0, 0): (1,), (2, 1): (0,)}
    # Brute force over every query and key of the chunk: all beyond, and the others not.
    for c, part in fwd.local_chunks:
        keys = (c - 1) * 128 + part * 64 + np.arange(64)
        for half in range(2):
            distance = np.abs(half * 64 + np.arange(64)[:, None] - keys[None, :])
            assert (distance.min() > 127) == (half in fwd.beyond(c, part))
    assert fwd.flops(2, 0) * 6 == whole.flops(2, 0) * 5
    assert not any(whole.beyond(*chunk) for chunk in whole.local_chunks)
    # A block too short to halve into whole tiles (W = 8) is not split.
    short = encoder_geometry.geometry(q, 8, 0, 16)
    assert short.splits(short.kernel("fwd")).split == 1


def test_each_launch_setting_runs_its_own_program():
    """`bench kernels --launch` times each setting's program: a second setting compiles anew
    (the settings are no part of jit's cache key, so one jitted function ran the first
    setting's program for all), and the whole one half the (default) split forward's programs."""
    # A layer no other test runs, so that no earlier test has traced it under WHOLE.
    config = LongT5Config.preset("tiny", "local", local_radius=31, attention_kernel="pallas")
    params, inputs, cotangent = kernel_checks.layer_problem(config, 1, 66, False)
    kernel_checks.run_layer(config, params, inputs, cotangent)
    events = []

    def listen(event, duration, **_):
        events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        kernel_checks.run_layer(config, params, inputs, cotangent, launch=WHOLE)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert "/jax/core/compile/jaxpr_trace_duration" in events, events  # traced under WHOLE
    grids = {}
    for launch in ((), WHOLE):
        step = kernel_checks.layer_loss_grad(config, "encoder", launch)
        jaxpr = jax.make_jaxpr(step)(params, inputs, cotangent, inputs["x"])
        grids[launch] = [
            e.params["grid_mapping"].grid
            for e in _eqns(jaxpr.jaxpr)
            if e.primitive.name == "pallas_call" and "attention_fwd" in str(e.params["name"])
        ]
    assert [g[2] for g in grids[()]] == [2 * g[2] for g in grids[WHOLE]] != []


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


@pytest.mark.parametrize("case, blocks", [("tglobal", 8), ("tglobal_w8_packed", 2)])
def test_a_local_bias_gradient_program_sums_several_query_blocks(case, blocks, monkeypatch):
    """Each program of the local bias gradient sums R query blocks where N / R programs still
    fill the GPU (`encoder_geometry.DBIAS_PROGRAMS`); with one program enough, R is the largest
    of 8, 4, 2 dividing N: outputs and gradients as the XLA path's, with dropout too (rows of 3: a
    program's loop runs over R blocks x the batch)."""
    monkeypatch.setattr(encoder_geometry, "DBIAS_PROGRAMS", 1)
    _, radius, k, batch, length, heads, _ = CASES[case]
    q_BLHK = jax.ShapeDtypeStruct((batch, length, heads, 16), jnp.float32)
    assert encoder_geometry.geometry(q_BLHK, radius + 1, 0, k).bias_blocks == blocks
    test_fused_attention_matches_the_xla_path(case, ())
    test_fused_attention_drops_out_what_the_xla_path_drops(case, ())


def test_a_token_in_no_global_block_sees_no_side_key():
    """A segment shorter than a global block has no global, and its tokens see no side key,
    also where its id is reused by another run of the row (the kernels' side terms depend on a
    token's global block alone, `encoder_tiles.side_slab`): both paths agree, and the short run's
    outputs do not move when the globals of the run whose id it reuses do."""
    xla = LongT5Config.preset(
        "tiny", "transient-global", local_radius=3, global_block_size=4, num_heads=2
    )
    params, inputs, cotangent = kernel_checks.layer_problem(xla, 1, 32, True)
    seg, pos = np.zeros((1, 32), np.int32), np.zeros((1, 32), np.int32)
    start = 0
    for run, size in [(1, 16), (2, 8), (1, 3)]:  # the last run: id 1 again, under a block
        seg[0, start : start + size], pos[0, start : start + size] = run, np.arange(size)
        start += size
    blocks = global_blocks(jnp.asarray(seg), jnp.asarray(pos), 4)
    short = slice(24, 27)
    assert (np.asarray(blocks.block_ids)[0, short] == -1).all()
    inputs = {**inputs, "seg": jnp.asarray(seg), "blocks": blocks}
    cotangent = cotangent * jnp.asarray(seg > 0)[..., None]
    fused = dataclasses.replace(xla, attention_kernel="pallas")
    moved = {**inputs, "x": inputs["x"].at[0, :16].add(1.0)}  # run 1's tokens and globals
    runs = {}
    for config in (xla, fused):
        runs[config] = kernel_checks.run_layer(config, params, inputs, cotangent)
        out, out_moved = (
            runs[config][0],
            kernel_checks.run_layer(config, params, moved, cotangent)[0],
        )
        np.testing.assert_array_equal(out[0, short], out_moved[0, short])
        assert not np.allclose(out[0, :16], out_moved[0, :16])
    errors = kernel_checks.relative_errors(runs[fused], runs[xla], inputs["seg"][..., None] > 0)
    assert max(errors.values()) <= TOLERANCE, errors


# Without dropout in the slow run: the dropout case runs the same code and draws masks too.
@pytest.mark.parametrize(
    "dropout, remat", [pytest.param(0.0, "none", marks=pytest.mark.slow), (0.2, "save_attention")]
)
def test_the_model_trains_the_same_with_the_kernels(dropout, remat):
    """Loss and every parameter's gradient of a whole (tiny, TGlobal, padded) model, with and
    without dropout (the kernels drop the attention probabilities the XLA path drops), and
    with the kernels' outputs kept by remat while the rest of each layer is recomputed."""
    xla = LongT5Config.preset("tiny", dropout_rate=dropout)
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(2, xla.vocab_size, (2, 27)), jnp.int32)
    mask = jnp.asarray(np.arange(27)[None] < np.array([[27], [19]]), jnp.int32)
    targets = jnp.asarray(rng.integers(2, xla.vocab_size, (2, 6)), jnp.int32)
    params = jax.jit(LongT5(xla).init)(jax.random.key(0), ids, mask, targets)["params"]
    train = dict(deterministic=False, rngs={"dropout": jax.random.key(3)}) if dropout else {}

    def loss(params, config):
        logits = LongT5(config).apply({"params": params}, ids, mask, targets, **train)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    want_loss, want = grad(params, xla)
    got_loss, got = grad(params, dataclasses.replace(xla, attention_kernel="pallas", remat=remat))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert float(jnp.max(jnp.abs(g - w))) <= TOLERANCE * float(jnp.max(jnp.abs(w)))
    if dropout:  # it did drop out
        assert abs(float(want_loss) - float(grad(params, LongT5Config.preset("tiny"))[0])) > 1e-3


def test_save_attention_is_full_remat_on_the_xla_path():
    """With XLA's attention no array carries the kernels' name, so save_attention lowers to full
    remat's program (the run files' policy costs nothing there); with the kernels it differs."""
    ids = jnp.ones((2, 40), jnp.int32)
    mask, targets = jnp.ones_like(ids), jnp.ones((2, 6), jnp.int32)
    xla = LongT5Config.preset("tiny", num_encoder_layers=2, num_decoder_layers=2)
    params = jax.eval_shape(lambda: LongT5(xla).init(jax.random.key(0), ids, mask, targets))

    def lowered(config):
        def loss(p):
            return jnp.sum(LongT5(config).apply(p, ids, mask, targets))

        text = jax.jit(jax.grad(loss)).lower(params).as_text()
        return re.sub(r"loc\([^)]*\)", "", text)  # source locations differ by call

    def programs(kernel):
        c = dataclasses.replace(xla, attention_kernel=kernel)
        return [lowered(dataclasses.replace(c, remat=r)) for r in ("full", "save_attention")]

    full, saved = programs("xla")
    assert full == saved
    full, saved = programs("pallas")
    assert full != saved


GPU_CONFIG = LongT5Config.preset(
    "tiny", "tglobal", d_model=64, d_ff=256, d_kv=16, local_radius=15, attention_kernel="pallas"
)
KERNELS = {f"encoder_attention_{k}" for k in ("fwd", "dq", "dkv", "dbias", "dside")}
KERNELS |= {f"decoder_attention_{k}" for k in ("fwd", "dq", "dkv", "dbias")}


def _triton_kernels(text: str) -> set[str]:
    return {k for k in KERNELS if f'name = "{k}.flops_' in text}


def _calls(text: str, kernel: str) -> int:
    """Call sites of a kernel in a compiled program (a scanned stack's: one per loop body)."""
    return sum("custom-call(" in line and f'"{kernel}.flops_' in line for line in text.splitlines())


@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
@pytest.mark.parametrize(
    "target, dropout, remat",
    [
        ("h100-80gb", 0.1, "save_attention"),
        pytest.param("a100-80gb", 0.0, "none", marks=pytest.mark.slow),
    ],
)
def test_the_kernels_compile_for_gpus_inside_the_train_step(target, dropout, remat):
    """Triton lowering and XLA's GPU compile of the single-device step, deviceless (with
    dropout: a step given a key, the hash inside every kernel). Under save_attention each
    forward kernel runs in the forward scan only, as without remat: the encoder's once, the
    decoder's twice (self- and cross-attention); full remat compiles 2 and 4 call sites."""
    devices = targets.devices(targets.load(target), 1, 1)
    config = dataclasses.replace(GPU_CONFIG, dropout_rate=dropout, remat=remat)
    step = compile_ahead.sharded_step(
        config, ParallelConfig(1, 1, 1, 0), devices=devices, per_node=1
    )
    key = jax.eval_shape(lambda: jax.random.key(0))
    rng = jax.ShapeDtypeStruct((), key.dtype, sharding=NamedSharding(step.mesh, PartitionSpec()))
    text = compile_ahead.compile_step(step, 2, 128, 16, rng if dropout else None).as_text()
    assert _triton_kernels(text) == KERNELS
    assert _calls(text, "encoder_attention_fwd") == 1
    assert _calls(text, "decoder_attention_fwd") == 2


@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
def test_auto_takes_the_kernels_on_gpus_and_xla_elsewhere():
    """attention_kernel="auto": the train step and the generator make it concrete for their
    mesh's devices (a deviceless H100's: the kernels; an A100's: the kernels but for float32;
    a V100's and this host's CPUs: XLA's attention), the model for the default device where
    nothing did, and the GPU roofline counts what the kernels rerun."""
    auto = dataclasses.replace(GPU_CONFIG, attention_kernel="auto")
    h100 = targets.devices(targets.load("h100-80gb"), 1, 1)
    gpu = compile_ahead.sharded_step(auto, ParallelConfig(1, 1, 1, 0), devices=h100, per_node=1)
    assert gpu.model.config.attention_kernel == "pallas"
    # An A100: the kernels in half precision, XLA's attention for float32, whose backward
    # kernels ptxas spills there (test_bench_sass); the kernels asked for by name stay.
    a100 = targets.devices(targets.load("a100-80gb"), 1, 1)
    for dtype, want in (("bfloat16", "pallas"), ("float32", "xla")):
        config = dataclasses.replace(auto, dtype=dtype)
        step = compile_ahead.sharded_step(
            config, ParallelConfig(1, 1, 1, 0), devices=a100, per_node=1
        )
        assert step.model.config.attention_kernel == want, dtype
    wide = dataclasses.replace(GPU_CONFIG, dtype="float32")
    step = compile_ahead.sharded_step(wide, ParallelConfig(1, 1, 1, 0), devices=a100, per_node=1)
    assert step.model.config.attention_kernel == "pallas"
    batch = compile_ahead.abstract_batch(gpu, 2, 128, 16)
    assert "encoder_attention_fwd" in gpu.lower(gpu.abstract_state, batch).as_text()
    # A V100 (compute capability 7.0), which Triton does not compile for: XLA's attention, and
    # the kernels asked for by name refused in one line.
    v100 = targets.devices(targets.load("v100-32gb"), 1, 1)
    old = compile_ahead.sharded_step(auto, ParallelConfig(1, 1, 1, 0), devices=v100, per_node=1)
    assert old.model.config.attention_kernel == "xla"
    with pytest.raises(ConfigError, match=r"^LongT5Config.attention_kernel='pallas': Tesla V100"):
        compile_ahead.sharded_step(GPU_CONFIG, ParallelConfig(1, 1, 1, 0), devices=v100, per_node=1)

    one = ParallelConfig(data=1)
    mesh = make_mesh(one, jax.devices()[:1])
    cpu = ShardedStep(LongT5(auto), StepConfig(), optax.sgd(0.1), mesh, one)
    assert cpu.model.config.attention_kernel == "xla"
    generator = Generator(LongT5(auto), None, mesh, one, DecodeConfig(), 4)
    assert generator.model.config.attention_kernel == "xla"
    assert not fused(auto)  # the default device here is a CPU
    ids = jnp.ones((2, 128), jnp.int32)
    model = LongT5(auto)
    params = jax.eval_shape(model.init, jax.random.key(0), ids, None, ids[:, :16])
    jaxpr = jax.make_jaxpr(model.apply)(params, ids, None, ids[:, :16])
    assert "pallas_call" not in str(jaxpr)
    assert "pallas_call" in str(
        jax.make_jaxpr(LongT5(GPU_CONFIG).apply)(params, ids, None, ids[:, :16])
    )

    xla = dataclasses.replace(GPU_CONFIG, attention_kernel="xla")
    executed = [
        flops.executed_flops_per_step(c, 2, 128, 16, "save_attention")
        for c in (auto, GPU_CONFIG, xla)
    ]
    assert executed[0] == executed[1] < executed[2]  # XLA's path reruns the attention


@pytest.mark.slow
@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
@pytest.mark.parametrize(
    "launch",
    [
        pytest.param((), id="default"),
        pytest.param(SPLIT, id="split"),
        pytest.param(TWO_AN_SM, id="two-an-sm"),
    ],
)
def test_a_published_size_layer_compiles_for_an_h100(launch):
    """A base TGlobal layer (blocks of 128, chunks of 64 side keys) forward and backward,
    deviceless for an H100, by default, with the forward and dq split into 4-warp programs
    of 64 queries, and as `gpu_check.sh` first tries its kernels (fewer keys a tile, the local
    keys looped: two programs an SM): float32 tiles fit its shared memory (at 3 stages the side
    gradient's kernel asked 264 KiB of 227 and the GPU refused it), and no bias table's
    gradient is a scatter-add (XLA had fused the side table's sums by distance into one:
    B*H*N*U*G atomic adds into 12 x 32 entries, 1 ms a layer on an H100)."""
    b, length = 1, 1024  # the shortest with chunks of 64 side keys
    # float32: the widest tiles (bfloat16 ones take half the shared memory).
    dtype = "float32"
    config = LongT5Config.preset("base", "tglobal", attention_kernel="pallas", dtype=dtype)
    layer = LongSelfAttention(config, True)

    def loss(params, x, local_table, side_table, seg, pos):
        blocks = global_blocks(seg, pos, config.global_block_size)
        bias = local_bias(config, local_table)
        return jnp.sum(layer.apply({"params": params}, x, seg, bias, blocks, side_table))

    device = targets.devices(targets.load("h100-80gb"), 1, 1)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    table = (config.num_heads, config.relpos_buckets)
    x = jax.ShapeDtypeStruct((b, length, config.d_model), jnp.dtype(dtype), sharding=sharding)
    ids = jax.ShapeDtypeStruct((b, length), jnp.int32, sharding=sharding)
    tables = [jax.ShapeDtypeStruct(table, jnp.float32, sharding=sharding)] * 2
    params = kernel_checks.layer_problem(
        dataclasses.replace(config, dtype="float32"), 1, 128, False
    )[0]
    params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), params
    )

    def traced(*args):  # the launch settings in force where the kernels are traced
        with kernel_launch.launch(launch):
            return jax.grad(loss, argnums=(0, 1, 2, 3))(*args)

    grad = jax.jit(traced)
    # At the matmul precision users run (the tests ask for "highest", which makes the kernels'
    # float32 matmuls IEEE FMAs: no tensor-core tiles, nothing staged through shared memory).
    # A compile-only program cannot be read back from the persistent cache: not written there.
    precision = jax.default_matmul_precision("default")
    with precision, compile_ahead._persistent_cache(False), targets.tracing_for([device]):
        text = grad.lower(params, x, *tables, ids, ids).compile().as_text()
    assert _triton_kernels(text) == {k for k in KERNELS if k.startswith("encoder")}
    # The forward compiled is the launch's: its declared FLOPs count the local keys it skips.
    q = jax.ShapeDtypeStruct((b, length, config.num_heads, config.d_kv), jnp.float32)
    geo = encoder_geometry.geometry(
        q, config.local_radius + 1, length // config.global_block_size, 16
    )
    with kernel_launch.launch(launch):
        flops = geo.splits("encoder_attention_fwd").flops(2, 2)
    assert f'"encoder_attention_fwd.flops_{flops}"' in text
    assert (flops < geo.flops(2, 2)) == (launch == SPLIT)  # a split skips keys beyond it
    # No scatter-add writes a bias table: each is a sum (a reduction, a one-hot matmul).
    table_type = re.escape(f"f32[{table[0]},{table[1]}]{{1,0}}")
    assert not re.search(rf"= {table_type} scatter\(", text)


# In the slow run (25-30 s of compiles): the default run compiles the kernels in the sharded
# train step for A100s and H100s, and on each device's rows and heads. Here tensor 2 x pipeline
# 2 (a shard_map manual over the stages) with 2 accumulation microbatches: the kernels' own
# region over `tensor` nested in the step's region over the stages (a pipeline alone is the
# same region without the nesting).
STAGED = [
    pytest.param(
        "a100-80gb", ParallelConfig(1, 2, 2, 0, pipeline_microbatches=2), 2,
        marks=pytest.mark.slow,
    ),
]  # fmt: skip


@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
@pytest.mark.parametrize("target, parallel, microbatches", STAGED)
def test_the_kernels_compile_in_pipeline_stages_and_move_no_more_bytes(
    target, parallel, microbatches
):
    """The kernels run on each stage's rows (and heads) and the step's collectives are those of
    the XLA path, byte for byte."""
    gpus = parallel.tensor * parallel.pipeline
    devices = targets.devices(targets.load(target), 1, gpus)
    deep = dict(num_encoder_layers=4, num_decoder_layers=4, remat="full")
    steps = {
        kernel: compile_ahead.compile_for(
            dataclasses.replace(GPU_CONFIG, attention_kernel=kernel, **deep),
            parallel,
            devices,
            gpus,
            (8, 128, 16),
            StepConfig(microbatches=microbatches),
        )  # fmt: skip
        for kernel in ("xla", "pallas")
    }
    assert _triton_kernels(steps["pallas"].executable.as_text()) == KERNELS
    moved = {k: hlo.bytes_by_kind(s.collectives) for k, s in steps.items()}
    assert moved["pallas"] == moved["xla"]


@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
def test_the_kernels_run_on_each_devices_rows_and_heads_and_move_no_more_bytes():
    """Data 2 x tensor 2: each device's kernels see its own rows and heads (a shard_map), so the
    step's collectives are the XLA path's, byte for byte (GSPMD alone would gather every
    operand of a custom call)."""
    devices = targets.devices(targets.load("a100-80gb"), 1, 4)
    steps = {
        kernel: compile_ahead.compile_for(
            dataclasses.replace(GPU_CONFIG, attention_kernel=kernel),
            ParallelConfig(2, 2, 1, 1),
            devices,
            4,
            (8, 128, 16),
        )  # fmt: skip
        for kernel in ("xla", "pallas")
    }
    assert _triton_kernels(steps["pallas"].executable.as_text()) == KERNELS
    moved = {k: hlo.bytes_by(s.collectives, s.placement)["axes"] for k, s in steps.items()}
    assert moved["pallas"] == moved["xla"]


# (data, tensor, pipeline, ZeRO stage), accumulation microbatches, attention dropout
KERNEL_LAYOUTS = [
    ((2, 2, 1, 1), 1, 0.0),
    pytest.param((4, 1, 1, 1), 1, 0.0, marks=pytest.mark.slow),  # data alone: its rows only
    ((2, 2, 1, 1), 1, 0.1),
    # Tensor parallel kernels inside the step's region: an accumulation loop, pipeline stages.
    pytest.param((2, 2, 1, 1), 2, 0.0, marks=pytest.mark.slow),
    pytest.param((2, 2, 2, 3), 1, 0.1, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh, microbatches, dropout", KERNEL_LAYOUTS)
def test_sharded_steps_with_the_kernels_equal_one_device(mesh, microbatches, dropout):
    """SGD steps of the tiny model, kernels interpreted on each device's rows and heads, against
    the XLA path on one device (test_step's batches and tolerance); with dropout, the masks
    follow the rows and heads, not the layout."""
    tiny = LongT5Config.preset("tiny", dropout_rate=dropout)

    def run(config, parallel, devices):
        model = LongT5(config, runner=parallel.pipeline_schedule())
        step_cfg = StepConfig(microbatches=microbatches)
        step = ShardedStep(model, step_cfg, optax.sgd(0.5), make_mesh(parallel, devices), parallel)
        state, losses = step.init(jax.random.key(0)), []
        for i, batch in enumerate(tiny_batches(n=2)):
            key = jax.random.fold_in(jax.random.key(7), i) if dropout else None
            state, metrics = step(state, batch, key)
            losses.append(float(metrics["loss"]))
        return np.array(losses), jax.tree.map(np.asarray, state.params)

    want = run(tiny, ParallelConfig(data=1), jax.devices()[:1])
    pallas = dataclasses.replace(tiny, attention_kernel="pallas")
    parallel = ParallelConfig(*mesh, pipeline_microbatches=2 if mesh[2] > 1 else 0)
    devices = jax.devices()[: mesh[0] * mesh[1] * mesh[2]]
    assert_same_training(run(pallas, parallel, devices), want)


@pytest.mark.parametrize(
    "case, launch",
    [
        pytest.param("tglobal_packed", (), marks=pytest.mark.slow, id="tglobal_packed"),
        pytest.param("local", (), id="local"),
        pytest.param("tglobal_w32_packed", (), id="tglobal_w32_packed"),
        pytest.param("tglobal_w32_packed", SPLIT, id="tglobal_w32_packed-split"),
    ],
)
def test_fused_attention_drops_out_what_the_xla_path_drops(case, launch):
    """With attention dropout both paths draw `layers.attention_keep`'s masks from the layer's
    seed and the global row, head, query and key: outputs and gradients agree (so with query
    blocks split into programs too: the masks follow the rows, not the layout)."""
    attention, radius, k, batch, length, heads, packed = CASES[case]
    xla = LongT5Config.preset(
        "tiny", attention, local_radius=radius, global_block_size=k, num_heads=heads,
        dropout_rate=0.3,
    )  # fmt: skip
    params, inputs, cotangent = kernel_checks.layer_problem(xla, batch, length, packed)
    rows = Rows(jnp.asarray([5, 2, 7][:batch], jnp.int32), jnp.asarray(3))

    def run(config):
        def loss(params, x, local_table, side_table):
            out = LongSelfAttention(config, False).apply(
                {"params": params}, x, inputs["seg"], local_bias(config, local_table),
                inputs["blocks"], side_table, rows, rngs={"dropout": jax.random.key(4)},
            )  # fmt: skip
            return jnp.sum(out * cotangent), out

        args = (params, inputs["x"], inputs["local_table"], inputs["side_table"])
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(*args)
        return out, grads

    want = run(xla)
    with kernel_launch.launch(launch):
        got = run(dataclasses.replace(xla, attention_kernel="pallas"))
    errors = kernel_checks.relative_errors(got, want, inputs["seg"][..., None] > 0)
    assert max(errors.values()) <= TOLERANCE, errors
    # Dropout did drop: the output differs from the deterministic layer's.
    plain = kernel_checks.run_layer(xla, params, inputs, cotangent)[0]
    assert float(jnp.max(jnp.abs(plain - want[0]))) > 0.1
