"""The deviceless GPU compile: the tiny model's train step compiled by XLA's GPU compiler for
8 nodes x 4 A100-80GB (compile-only devices, no GPU), and the HLO reader on those programs.

Checks: every shipped parallel config (and ZeRO-2 / ZeRO-3 circular pipelines, which none
ships) compiles with the shipped GPU options, keeps its tensor groups inside a node and moves,
kind by kind, what the analytic model says (within 15%);
per-device DP and ZeRO-1/2/3 bytes against the ring model within 10% (the GPU program has real
reduce-scatters); accumulation and pipelines reduce once (4 microbatches move no more than 1;
a pipeline little more than the same step without it); asynchronous collectives counted once;
mesh-spelled replica groups parsed; bytes attributed to NVLink or InfiniBand by where the mesh
puts the devices. For 2 nodes x 4 V100s (sm_70): the float16 step's kernels and GEMMs, and
bfloat16's GEMMs run in float32 (why a V100 refuses it). Skipped only without the `gpu` extra.
"""

import collections
import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import optax
import pytest
from helpers import CLUSTER_SHAPE, CLUSTER_STEP, zero_expected

from longt5_jax import configuration
from longt5_jax.estimate import comm_model, compile_ahead, cost, hlo, hlo_module, targets
from longt5_jax.estimate.shapes import ModelShapes
from longt5_jax.model import LongT5Config
from longt5_jax.parallel import xla_options
from longt5_jax.parallel.mesh import ParallelConfig
from longt5_jax.training.step import StepConfig

pytestmark = pytest.mark.skipif(
    not targets.have_gpu_compiler(), reason="the gpu extra (jax[cuda12]) is not installed"
)
ROOT = Path(__file__).resolve().parents[1]
CONFIG = LongT5Config.preset("tiny", "local", d_model=64, d_ff=256, d_kv=16)
SHAPE = (128, 64, 16)  # global batch, input length, target length


@pytest.fixture(scope="module")
def a100():
    target = targets.load("a100-80gb")
    return target, targets.devices(target, 8, 4), cost.Cluster.of(target, 8, 4)


@pytest.fixture(scope="module")
def zero_steps(a100):
    """DP32 at each ZeRO stage, compiled once for the module."""
    _, devices, _ = a100
    return {
        stage: compile_ahead.compile_for(CONFIG, ParallelConfig(-1, 1, 1, stage), devices, 4, SHAPE)
        for stage in (0, 1, 2, 3)
    }


def _tensor_degree(path: str) -> int:
    configuration.parse([path], [])
    return configuration.build(ParallelConfig).tensor


def _compile_configs(paths: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu_compile_configs.py"), *paths],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )


@pytest.mark.slow  # two minutes of compiles: `.ci/run` runs it with the slow tests
def test_every_shipped_parallel_config_compiles_for_the_a100_cluster(tmp_path):
    """...with its tensor groups inside a node, and each collective kind carrying at least 5% of
    the bytes within 15% of the analytic model (XLA adds a few small collectives of its own).

    So do two layouts no config ships but the planner ranks, ZeRO-2 and ZeRO-3 under a circular
    pipeline: the stage-major reorder moves each device's ZeRO shard, not a stage's whole
    layers, and the gradients of the weights outside the stages are reduce-scattered over data
    and pipeline, then gathered over pipeline. Left to XLA, they were all-reduced over both and
    sliced: 2 (dp - 1) / dp of their bytes instead of (dp + p - 2) / dp. Before, the
    reduce-scatters were 0.80-0.88 of the model, and the reorder 0.06-0.69 of a model blind to
    ZeRO."""
    configs = sorted(str(p) for p in (ROOT / "configs" / "parallel").glob("*.gin"))
    assert len(configs) >= 9
    for name, tensor, zero in (("pp2_r2_zero2", 1, 2), ("tp2_pp2_r2_zero3", 2, 3)):
        path = tmp_path / f"{name}.gin"
        path.write_text(
            f"ParallelConfig.tensor = {tensor}\nParallelConfig.pipeline = 2\n"
            "ParallelConfig.pipeline_microbatches = 4\nParallelConfig.pipeline_repeats = 2\n"
            f"ParallelConfig.zero_stage = {zero}\n"
        )
        configs.append(str(path))
    # XLA's GPU compiler runs on one core: the configs are shared out to a process per core,
    # those of one tensor degree to the same process, where their kernels (sharded alike) come
    # from the process's kernel cache after the first.
    workers = max(1, min(len(configs), os.cpu_count() or 1, 4))
    by_tensor = sorted(configs, key=lambda path: (_tensor_degree(path), path))
    chunks = [
        by_tensor[len(configs) * i // workers : len(configs) * (i + 1) // workers]
        for i in range(workers)
    ]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        runs = list(pool.map(_compile_configs, chunks))
    for run in runs:
        assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    rows = [json.loads(line) for r in runs for line in r.stdout.splitlines() if line[:1] == "{"]
    rows.sort(key=lambda row: configs.index(row["path"]))
    assert [r["path"] for r in rows] == configs
    _assert_placed_and_modelled(rows, "bfloat16")


def _assert_placed_and_modelled(rows: list[dict], dtype: str) -> None:
    """Each compiled config's tensor groups inside a node, and each collective kind carrying at
    least 5% of the bytes within 15% of the analytic model."""
    shapes = ModelShapes.of(
        LongT5Config.preset(
            "tiny", "tglobal", dtype=dtype, remat="full", num_encoder_layers=4,
            num_decoder_layers=4,
        ),
        optax.adamw(1e-3),
    )  # fmt: skip
    for row in rows:
        assert all(len(nodes) == 1 for nodes in row["tensor_nodes"]), row["path"]
        configuration.parse([row["path"]], ["ParallelConfig.data = -1"])
        parallel = configuration.build(ParallelConfig)
        layout = comm_model.Layout.of(parallel, 32, CLUSTER_STEP, CLUSTER_SHAPE)
        want = comm_model.by_kind(comm_model.volumes(shapes, layout))
        for kind, (got, model, ratio) in comm_model.compare(row["bytes"], want).items():
            assert ratio is not None and 1 / 1.15 <= ratio <= 1.15, (row["path"], kind, got, model)


@pytest.mark.slow  # three compiles for 32 GPUs, ~40 s
def test_table_1s_configs_compile_in_float16_for_the_v100_cluster():
    """The shipped configs of Table 1's strategies (32 GPUs) compiled for 8 x 4 V100-32GB: in
    float16 with the loss scale in the state, within 32 GiB, tensor groups inside a node, and
    the collective bytes within 15% of the analytic model, as on the A100 cluster."""
    names = ("dp32_zero2", "dp8_tp4", "dp4_tp4_pp2")
    configs = [str(ROOT / "configs" / "parallel" / f"{name}.gin") for name in names]
    run = _compile_configs(["--target", "v100-32gb", *configs])
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    rows = [json.loads(line) for line in run.stdout.splitlines() if line[:1] == "{"]
    assert [r["path"] for r in rows] == configs
    for row in rows:
        assert row["dtype"] == "float16" and row["loss_scale"], row["path"]
        assert 0 < row["memory"] <= 32 * 2**30
    _assert_placed_and_modelled(rows, "float16")


def test_deviceless_compiles_keep_a_kernel_cache_file_per_process(zero_steps, monkeypatch):
    kind = zero_steps[0].step.mesh.devices.flat[0].device_kind
    path = Path(compile_ahead._kernel_cache(kind)["xla_gpu_kernel_cache_file"])
    assert path.stat().st_size > 0  # XLA wrote the kernels of the fixture's four compiles there
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_kernel_cache_file=/tmp/kernels.bin")
    assert compile_ahead._kernel_cache(kind) is None  # the user's file rules


def test_a_kept_kernel_directory_is_one_live_process_s(tmp_path, monkeypatch):
    """XLA rewrites a cache file whole: a directory held by a live process is refused to
    another (here a second holder in this process, as flock locks open files)."""
    monkeypatch.setattr(compile_ahead, "_kernel_home", None)
    assert compile_ahead.keep_kernels_in(tmp_path / "kernels")
    assert compile_ahead._kernel_dir() == tmp_path / "kernels"
    monkeypatch.setattr(compile_ahead, "_kernel_home", None)
    assert not compile_ahead.keep_kernels_in(tmp_path / "kernels")
    assert compile_ahead._kernel_home is None  # this one keeps a temporary directory


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_bytes_match_the_ring_model_on_gpu_hlo(zero_steps, stage):
    compiled = zero_steps[stage]
    measured = hlo.bytes_by_kind(compiled.collectives)
    expected = zero_expected(compiled.step, stage, cpu=False)
    print(f"ZeRO-{stage} measured {measured}\nanalytic {expected}")
    reduced = measured["all-reduce"] + measured["reduce-scatter"]
    want = expected["all-reduce"] + expected["reduce-scatter"]
    assert reduced == pytest.approx(want, rel=0.10)
    if stage >= 2:  # the GPU compiler reduce-scatters the split gradients (CPU: all-reduce)
        assert measured["reduce-scatter"] == pytest.approx(expected["reduce-scatter"], rel=0.10)
    else:
        assert measured["reduce-scatter"] == 0
    if stage >= 1:
        assert measured["all-gather"] == pytest.approx(expected["all-gather"], rel=0.10)
    assert measured["collective-permute"] == 0


def test_async_collectives_are_counted_once_with_their_mesh_groups(zero_steps):
    text = zero_steps[2].executable.as_text()
    starts = [i for _, _, i in hlo_module.instructions(text) if i.opcode.endswith("-start")]
    starts = [i for i in starts if i.opcode.removesuffix("-start") in hlo.KINDS]
    dones = [i for _, _, i in hlo_module.instructions(text) if i.opcode.endswith("-done")]
    assert starts and len(dones) >= len(starts)
    ops = hlo.collectives(text)
    assert sorted(op.name for op in ops) == sorted(i.name for i in starts)
    assert any("replica_groups=mesh[" in i.attrs for i in starts)
    # The shipped options reached the compiler: the latency-hiding scheduler made them async.
    assert any('"is_sync":false' in i.attrs for i in starts)
    assert all(op.groups is not None and op.group_size == 32 for op in ops)


def test_bytes_go_to_nvlink_inside_a_node_and_infiniband_across(a100):
    """Tensor 4 x data 8: tensor groups are one node's 4 GPUs (NVLink), data groups one GPU of
    each node (InfiniBand). Tensor 8 cannot fit a node: the mesh says so, and its tensor
    traffic crosses nodes."""
    _, devices, cluster = a100
    local = compile_ahead.compile_for(CONFIG, ParallelConfig(8, 4, 1, 0), devices, 4, SHAPE)
    near = local.analyse(cluster)["collectives"]
    tensor = near["kind_link"].get("all-reduce nvlink", 0)
    assert tensor > 0 and near["axes"]["all-reduce over tensor"] == pytest.approx(tensor, rel=1e-6)
    assert near["axes"]["all-reduce over data"] > 0 and near["link"]["ib"] > 0
    tensor_ops = [op for op in local.collectives if local.placement.axes(op) == ("tensor",)]
    assert tensor_ops and not any(op.spans(4) for op in tensor_ops)
    wide = LongT5Config.preset("tiny", "local", d_model=64, d_ff=256, d_kv=8, num_heads=8)
    with pytest.warns(UserWarning, match="tensor=8 does not divide the 4 devices of a node"):
        spread = compile_ahead.compile_for(wide, ParallelConfig(4, 8, 1, 0), devices, 4, SHAPE)
    far = spread.analyse(cluster)["collectives"]
    assert far["axes"]["all-reduce over tensor"] > 0
    assert far["kind_link"].get("all-reduce nvlink", 0) == 0  # every tensor group spans nodes


def test_accumulation_reduces_once(a100, zero_steps):
    """4 microbatches move what one does: gradients reduce-scattered once after the loop, none
    inside any loop (data parallelism alone: nothing else communicates)."""
    _, devices, _ = a100
    one = zero_steps[2]
    four = compile_ahead.compile_for(
        CONFIG, ParallelConfig(-1, 1, 1, 2), devices, 4, SHAPE, StepConfig(microbatches=4)
    )
    got, want = (sum(hlo.bytes_by_kind(c.collectives).values()) for c in (four, one))
    print(f"4 microbatches {got:.0f} bytes, 1 microbatch {want:.0f}")
    assert got <= 1.10 * want
    assert not [op for op in four.collectives if op.in_loop]


@pytest.mark.slow  # two compiles of 16-layer stacks for 32 GPUs, ~25 s
def test_a_pipeline_moves_little_more_than_without(a100):
    """Tensor 4 x pipeline 2 x data 4 against tensor 4 x data 8, same global batch: the stages
    reduce once, no weight moves, the head runs on 1/2 of the rows per stage; what is left are
    the stage shifts, the rows' ring and the bubble's (1/17) extra iterations (the analytic
    model: 1.12 here, 1.15 for LongT5-base at 4k, 1.10 for xl)."""
    _, devices, _ = a100
    # Stacks deep enough for 4 layers a stage, fully rematerialised, as pipelined models are.
    deep = dict(num_encoder_layers=8, num_decoder_layers=8, remat="full")
    config = LongT5Config.preset("tiny", "tglobal", d_model=64, d_ff=256, d_kv=16, **deep)
    plain = compile_ahead.compile_for(config, ParallelConfig(8, 4, 1, 1), devices, 4, SHAPE)
    piped = compile_ahead.compile_for(
        config, ParallelConfig(4, 4, 2, 1, pipeline_microbatches=16), devices, 4, SHAPE
    )
    got, want = (sum(hlo.bytes_by_kind(c.collectives).values()) for c in (piped, plain))
    print(f"pipelined {got:.0f} bytes, not {want:.0f}")
    assert got <= 1.15 * want
    data_in_loops = [
        op for op in piped.collectives if op.in_loop and "data" in piped.placement.axes(op)
    ]
    assert not data_in_loops


def _gemm_inputs(executable) -> collections.Counter:
    """The element types of each cuBLAS GEMM's two matrices in a compiled program, counted."""
    found = collections.Counter()
    for comp in hlo_module.Module.parse(executable.as_text()).computations.values():
        for i in comp.instrs:
            if i.opcode == "custom-call" and 'custom_call_target="__cublas' in i.attrs:
                found[tuple(comp.types[o].split("[")[0] for o in i.operands[:2])] += 1
    return found


def _v100_step(dtype: str, dump: Path | None = None) -> compile_ahead.CompiledStep:
    """The tiny model's data-parallel train step in `dtype`, compiled for 2 nodes x 4 V100s,
    XLA's dump of it (its kernels' PTX among it) in `dump`."""
    devices = targets.devices(targets.load("v100-32gb"), 2, 4)
    config, parallel = dataclasses.replace(CONFIG, dtype=dtype), ParallelConfig(-1, 1, 1, 0)
    if dump is None:
        return compile_ahead.compile_for(config, parallel, devices, 4, SHAPE)
    step = compile_ahead.sharded_step(config, parallel, devices=devices)
    lowered = step.lower(step.abstract_state, compile_ahead.abstract_batch(step, *SHAPE))
    with compile_ahead._persistent_cache(False):  # a compile-only program cannot be read back
        options = xla_options.dump_options(str(dump), every_emitter=True)  # jax 0.12's PTX
        return compile_ahead.CompiledStep(step, lowered.compile(options), 4)


@pytest.mark.slow  # ~10 s: the compile, and its dump of every kernel
def test_the_float16_step_compiles_for_the_v100(tmp_path):
    """For sm_70 (every kernel's PTX), within the V100's 32 GiB, its matmuls float16 GEMMs."""
    compiled = _v100_step("float16", tmp_path)
    assert compiled.step.mesh.devices.flat[0].compute_capability == "7.0"
    assert compiled.step.abstract_state.loss_scale is not None  # float16 scales its loss
    assert list(tmp_path.glob("*.sm_7.0_gpu_after_optimizations.txt"))
    ptx = [p.read_text() for p in tmp_path.glob("*.ptx")]
    targets_seen = {line for text in ptx for line in text.splitlines() if line[:8] == ".target "}
    assert targets_seen == {".target sm_70"}
    assert 0 < compiled.memory().total <= 32 * 2**30
    gemms = _gemm_inputs(compiled.executable)
    assert gemms[("f16", "f16")] >= 30 and not any("bf16" in pair for pair in gemms), gemms


@pytest.mark.slow
def test_xla_runs_bfloat16_matmuls_in_float32_on_the_v100():
    """Why bfloat16 is refused on a V100 (`parallel/devices.check_dtype`): XLA compiles it, but
    converts every GEMM's bfloat16 inputs to float32, so neither half-precision speed is had."""
    gemms = _gemm_inputs(_v100_step("bfloat16").executable)
    assert gemms and set(gemms) == {("f32", "f32")}, gemms
