"""bench roofline: Pallas Triton calls costed at their declared FLOPs, kernels grouped by the model
part their name stack says, the report written and compared, bad arguments refused in one line.

The GPU programs are compiled deviceless (the `gpu` extra, no GPU): a toy Pallas kernel in this
process, the tiny model's train step once in the command's own child process.
"""

import json
import re

import pytest

from longt5_jax.bench import roofline as bench
from longt5_jax.estimate import targets

needs_gpu_compiler = pytest.mark.skipif(
    not targets.have_gpu_compiler(), reason="the gpu extra (jax[cuda12]) is not installed"
)
CASE = "tiny:64:2:full"
ATTENTION = "LongT5.encode/encoder/EncoderLayer/attention"


# A scanned layer's kernels as XLA writes them: the slice of a stacked [24, 8, 16] bf16 buffer
# (directly, and through the bitcast XLA puts before the slice of a buffer in a transposed
# layout), its in-place update (through a bitcast too), and the update run on a stream of its
# own (jax 0.12: `fusion-start`, typed (operands, result, context), and `fusion-done`).
_STACKED = """HloModule step, is_scheduled=true

%slice (p0: bf16[24,8,16], p1: s32[]) -> bf16[1,8,16] {
  %p0 = bf16[24,8,16]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = bf16[1,8,16]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,8,16}
}

%slice_bitcast (p0: bf16[24,8,16], p1: s32[]) -> f32[16,8] {
  %p0 = bf16[24,8,16]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %t = bf16[16,24,8]{2,1,0} bitcast(%p0)
  %ds = bf16[16,1,8]{2,1,0} dynamic-slice(%t, %c, %p1, %c), dynamic_slice_sizes={16,1,8}
  %b = bf16[16,8]{1,0} bitcast(%ds)
  ROOT %f = f32[16,8]{1,0} convert(%b)
}

%update (p0: bf16[24,8,16], p1: bf16[8,16], p2: s32[]) -> bf16[24,8,16] {
  %p0 = bf16[24,8,16]{2,1,0} parameter(0)
  %p1 = bf16[8,16]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %c = s32[] constant(0)
  %t = bf16[24,8,16]{2,1,0} bitcast(%p0)
  %u = bf16[1,8,16]{2,1,0} bitcast(%p1)
  ROOT %dus = bf16[24,8,16]{2,1,0} dynamic-update-slice(%t, %u, %p2, %c, %c)
}

ENTRY %main (a: bf16[24,8,16], b: bf16[8,16], i: s32[]) -> bf16[24,8,16] {
  %a = bf16[24,8,16]{2,1,0} parameter(0)
  %b = bf16[8,16]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %s = bf16[1,8,16]{2,1,0} fusion(%a, %i), kind=kLoop, calls=%slice
  %sb = f32[16,8]{1,0} fusion(%a, %i), kind=kLoop, calls=%slice_bitcast
  %u = bf16[24,8,16]{2,1,0} fusion(%a, %b, %i), kind=kLoop, calls=%update
  %start = ((bf16[24,8,16]{2,1,0}, bf16[8,16]{1,0}, s32[]), bf16[24,8,16]{2,1,0}, u32[]) fusion-start(%u, %b, %i), kind=kLoop, calls=%update
  ROOT %done = bf16[24,8,16]{2,1,0} fusion-done(%start)
}
"""  # noqa: E501


def test_a_stacked_buffer_costs_its_slice_or_update_not_the_whole_buffer():
    from longt5_jax.estimate import hlo_module, roofline

    module = hlo_module.Module.parse(_STACKED)
    costs = {k.name: k.bytes for k in roofline.kernels(module, 1e15, 1e12)}
    layer, index = 8 * 16 * 2, 4  # one layer's slice of the stack (bf16), the s32 index
    assert costs == {
        "s": 2 * layer + index,  # the slice read, then written
        "sb": layer + index + 8 * 16 * 4,  # the slice read (through the bitcast), f32 written
        "u": 2 * layer + index,  # the update read, then written in place
        "start": 2 * layer + index,  # the same, asynchronous; its done launches nothing
    }


@needs_gpu_compiler
def test_a_triton_call_costs_its_operands_results_and_declared_flops():
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    from longt5_jax.estimate import hlo_module, roofline

    target = targets.load("h100-80gb")
    device = targets.devices(target, 1, 1)[0]

    def matmul(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    def call(name, x, y):
        return pl.pallas_call(
            matmul,
            out_shape=jax.ShapeDtypeStruct((16, 32), jnp.float32),
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
            name=name,
        )(x, y)

    def f(x, y):  # 2 x 16 x 32 x 64 FLOPs each; the second declares none
        return call("toy.flops_65536", x, y), call("undeclared", x, y)

    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((16, 64), jnp.bfloat16, sharding=sharding)
    y = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16, sharding=sharding)
    with targets.tracing_for([device]):
        module = hlo_module.Module.parse(jax.jit(f).lower(x, y).compile().as_text())
    peak, hbm = target.figures.peak_tflops * 1e12, target.hbm_gbps * 1e9
    calls = [k for k in roofline.kernels(module, peak, hbm) if k.opcode == "custom-call"]
    by_op = {bench.describe(k.op_name, k.name)[2]: k for k in calls}
    assert sorted(by_op) == ["toy", "undeclared"]
    toy = by_op["toy"]
    # bf16 operands 16x64 and 64x32 read, the f32 16x32 result written.
    assert toy.bytes == 16 * 64 * 2 + 64 * 32 * 2 + 16 * 32 * 4 == 8192
    assert (toy.fast_flops, toy.slow_flops) == (65536.0, 0.0)
    assert toy.compute_s == pytest.approx(65536 / peak) and toy.memory_s == 8192 / hbm
    assert by_op["undeclared"].fast_flops == 0.0 and by_op["undeclared"].bytes == 8192
    assert roofline.roofline(module, peak, hbm).flops == 65536.0
    # Both are Pallas calls by kind, declared FLOPs or not; nothing else does arithmetic.
    kinds = roofline.by_kind(roofline.kernels(module, peak, hbm))
    assert {k.kind for k in calls} == {"pallas"} and kinds["pallas"].kernels == 2
    assert (kinds["pallas"].flops, kinds["pallas"].bytes) == (65536.0, 2 * 8192)
    assert kinds["matmul"].flops == kinds["other"].flops == 0.0


@pytest.mark.parametrize(
    "op_name, kernel, expected",
    [
        (
            "jit(train_step)/transpose(jvp(LongT5))/LongT5.encode/encoder/while/body/closed_call/"
            "checkpoint/EncoderLayer/attention/bhnwk,bhgk->bhnwg/dot_general",
            "fusion.3",
            ("bwd", ATTENTION, "bhnwk,bhgk->bhnwg"),
        ),
        (
            "jit(train_step)/transpose(jvp(LongT5))/LongT5.encode/encoder/while/body/closed_call/"
            "checkpoint/rematted_computation/EncoderLayer/attention/attention._attend/reduce_max",
            "fusion.4",
            ("remat", ATTENTION + "/attention._attend", "reduce_max"),
        ),
        (
            "jit(train_step)/jvp(LongT5)/LongT5.decode/decoder/while/body/closed_call/DecoderLayer/"
            "encoder_decoder_attention/bthk,bshk->bhts/convert_element_type",
            "fusion.5",
            (
                "fwd",
                "LongT5.decode/decoder/DecoderLayer/encoder_decoder_attention",
                "bthk,bshk->bhts/convert_element_type",
            ),
        ),
        (
            "jit(step)/jvp(LongT5)/LongT5.encode/encoder/EncoderLayer/attention/"
            "encoder_attention_fwd.flops_123456789/pallas_call",
            "pallas_call.1",
            ("fwd", ATTENTION, "encoder_attention_fwd"),
        ),
        (  # jax 0.12 names a scanned layer's call `eval_jaxpr` where 0.10 says `closed_call`
            "jit(train_step)/transpose(jvp(LongT5))/LongT5.encode/encoder/while/body/eval_jaxpr/"
            "EncoderLayer/attention/bhnwk,bhgk->bhnwg/dot_general",
            "fusion.7",
            ("bwd", ATTENTION, "bhnwk,bhgk->bhnwg"),
        ),
        ("jit(train_step)/jit(_where)/select_n", "fusion.6", ("", "", "select_n")),
        ("", "loop_broadcast_fusion.12", ("", "", "loop_broadcast_fusion")),
    ],
)
def test_a_kernel_is_named_by_its_model_part_and_op(op_name, kernel, expected):
    assert bench.describe(op_name, kernel) == expected


@needs_gpu_compiler
def test_the_report_groups_kernels_and_compares_with_an_earlier_one(tmp_path, capsys):
    from longt5_jax.estimate import flops
    from longt5_jax.model import LongT5Config

    out = tmp_path / "out"
    before = tmp_path / "before.json"  # made up: the ratios are known
    row = {"case": CASE, "roofline": {"bytes": 1e6, "seconds": 1e-5}, "mfu": 0.25}
    before.write_text(json.dumps({"config": {}, "rows": [row, {"case": "other:1:1"}]}))
    argv = ["--cases", CASE, "--target_length", "16", "--top", "5", "--out_dir", str(out)]
    argv += ["--goal_mfu", "0.5", "--matmul_tflops", "1"]  # a rate that makes them compute-bound
    assert bench.main([*argv, "--compare", str(before)]) == 0  # one compile, in a child process
    stdout = capsys.readouterr().out
    written = json.loads((out / "roofline.json").read_text())
    assert (out / "roofline.png").stat().st_size > 10_000
    (row,) = written["rows"]
    total = row["roofline"]
    config = LongT5Config.preset("tiny", dtype="bfloat16", remat="full")
    assert row["ideal_s"] == flops.train_flops_per_step(config, 2, 64, 16) / 989e12
    assert row["mfu"] == pytest.approx(row["ideal_s"] / total["seconds"])
    # Every kernel in exactly one group.
    groups = row["groups"]
    assert sum(g["count"] for g in groups) == total["kernels"] > 100
    assert sum(g["bytes"] for g in groups) == pytest.approx(total["bytes"], rel=1e-9)
    assert sum(g["share"] for g in groups) == pytest.approx(1.0)
    assert [g["seconds"] for g in groups] == sorted((g["seconds"] for g in groups), reverse=True)
    # Every kernel in exactly one kind: XLA's attention, so no Pallas call; the dots' FLOPs are
    # the matmuls'. The goal: its step time, the matmuls at the rate asked (slower than at the
    # peak), and what that leaves the Pallas kernels.
    kinds = row["kinds"]
    for field in ("kernels", "bytes", "seconds", "flops"):
        assert sum(k[field] for k in kinds.values()) == pytest.approx(total[field], rel=1e-9)
    assert kinds["pallas"]["kernels"] == 0 and kinds["matmul"]["kernels"] > 10
    assert kinds["matmul"]["flops"] == total["flops"] and kinds["other"]["flops"] == 0
    goal = row["goal"]
    assert goal["seconds"] == pytest.approx(row["ideal_s"] / 0.5) and goal["matmul_tflops"] == 1
    assert goal["matmul_s"] >= max(kinds["matmul"]["seconds"], kinds["matmul"]["flops"] / 1e12)
    assert goal["matmul_s"] > kinds["matmul"]["seconds"]
    left = goal["seconds"] - goal["matmul_s"] - kinds["other"]["seconds"]
    assert goal["pallas_tflops"] == bench.rate_needed(0.0, left) / 1e12
    kind_line = next(x for x in stdout.splitlines() if x.startswith(CASE) and " at 1 " in x)
    assert f"{goal['seconds'] * 1e3:8.1f}" in kind_line
    # The encoder's attention einsums sit in the encoder attention group, in all three passes.
    einsums = {(g["direction"], g["part"]) for g in groups if g["op"] == "bhnwk,bhgk->bhnwg"}
    assert {d for d, _ in einsums} == {"fwd", "bwd", "remat"}
    assert all(p == ATTENTION or p.startswith(ATTENTION + "/") for _, p in einsums), einsums
    plumbing = re.compile(r"jit\(|jvp\(|transpose\(|/while|checkpoint|closed_call|rematted")
    assert not [g["part"] for g in groups if plumbing.search(g["part"])]
    # The table lists the top 5 groups, costliest first; the comparison is after / before.
    lines = stdout.splitlines()
    start = lines.index(f"{CASE}: top 5 of {len(groups)} groups") + 2
    listed = [x for x in lines[start : start + 6] if x.startswith("  ")]
    assert len(listed) == 5 and listed[0].endswith(f"{groups[0]['part']}  {groups[0]['op']}")
    (change,) = written["comparison"]
    assert change["bytes"]["ratio"] == total["bytes"] / 1e6
    assert change["roofline_s"]["ratio"] == total["seconds"] / 1e-5
    assert change["mfu"]["ratio"] == row["mfu"] / 0.25
    line = next(x for x in stdout.splitlines()[::-1] if x.startswith(CASE))
    assert f"{change['bytes']['ratio']:6.3f}" in line and f"{row['mfu']:6.1%}" in line


def test_the_goal_leaves_the_pallas_kernels_what_the_rest_does_not_take():
    # base 16k x 2 on an H200 (deviceless): 79.2 ms at 35% MFU, less the matmuls at the 8192^3
    # matmul's measured 635 TFLOP/s (41.0 ms) and the rest at bandwidth (13.8 ms), for 11.2 TFLOP.
    assert bench.rate_needed(11.2e12, 79.2e-3 - 41.0e-3 - 13.8e-3) == pytest.approx(459e12, 1e-3)
    assert bench.rate_needed(0.0, 1e-3) == 0.0
    assert bench.rate_needed(1e12, 0.0) == bench.rate_needed(1e12, -1e-3) == float("inf")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--cases", "base:4096"], "expected MODEL:INPUT_LENGTH:BATCH[:REMAT]"),
        (["--cases", "huge:4096:1"], "unknown LongT5 preset 'huge'"),
        (["--target", "v100"], "--target 'v100'"),
        (["--target", "cpu"], "bench roofline costs GPU kernels"),
        (["--top", "0"], "argument --top: expected an integer >= 1"),
        (["--goal_mfu", "0"], "argument --goal_mfu: expected a number in (0, 1], got 0.0"),
        (["--goal_mfu", "35"], "argument --goal_mfu: expected a number in (0, 1], got 35.0"),
        (["--matmul_tflops", "0"], "argument --matmul_tflops: expected a number > 0, got 0.0"),
        (
            ["--matmul_tflops", "fast"],
            "argument --matmul_tflops: expected a number > 0, got 'fast'",
        ),
        (["--compare", "{d}/missing.json"], "missing.json: No such file or directory"),
        (["--compare", "{d}/not_a_report.json"], "not a report of bench roofline"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, argv, says):
    (tmp_path / "not_a_report.json").write_text('{"rows": 3}')
    argv = [a.format(d=tmp_path) for a in argv] + ["--out_dir", str(tmp_path / "out")]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "out").exists()


def test_the_command_is_registered():
    from longt5_jax.bench.__main__ import BENCHMARKS

    assert BENCHMARKS["roofline"] is bench.main


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_the_step_updates_with_the_optimizer_asked_for(optimizer):
    """--optimizer reaches the benchmarked step (built, not compiled): AdamW keeps two moments
    a parameter; Adafactor (the training loop's default) keeps no first and factors the second
    of each matrix (base's sides are all >= 128)."""
    import jax
    import numpy as np

    from longt5_jax.bench import device

    case = "base:64:2:full"
    args = bench._parser().parse_args(["--cases", case, "--optimizer", optimizer])
    _, step, _, _ = device.case_step(args, case, jax.devices())

    def size(tree):
        return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))

    state = step.abstract_state
    ratio = size(state.opt_state) / size(state.params)
    assert 1.99 < ratio < 2.01 if optimizer == "adamw" else ratio < 0.01
    argv = device.step_argv(args)  # what a case's child process is given
    assert argv[argv.index("--optimizer") + 1] == optimizer
