"""The planner ranks candidates, compiles the best (for the A100 cluster with XLA's GPU
compiler, deviceless, or on the test's 8 fake CPU devices), prints the gin flags that select
them, and turns bad input into one line and exit status 2. Compile targets load, carry their
figures and half precision (float16 on a V100, which has no bfloat16: refused there, by the
commands and by a run's devices), and place devices on nodes."""

import dataclasses
import re
import types
from pathlib import Path

import jax
import pytest
from helpers import NO_BF16, SMALL_PLAN

from longt5_jax import plan
from longt5_jax.errors import ConfigError
from longt5_jax.estimate import candidates, cost, memory_model, targets
from longt5_jax.model import LongT5Config
from longt5_jax.parallel import devices as local
from longt5_jax.parallel.mesh import node_of

GPU = pytest.mark.skipif(
    not targets.have_gpu_compiler(), reason="the gpu extra (jax[cuda12]) is not installed"
)


def _check_gin(out: str) -> None:
    best = out.split("best, as gin flags:")[1]
    assert "--gin.ParallelConfig.data=" in best and "--gin.ParallelConfig.zero_stage=" in best
    assert "--gin.LongT5Config.remat=" in best and "--gin.DataConfig.batch_size=16" in best


def test_plan_ranks_and_prints_gin(capsys):
    assert plan.main([*SMALL_PLAN, "--compile_top", "0"]) == 0
    out = capsys.readouterr().out
    assert "candidates divide" in out and "est GiB/dev" in out and "compiling" not in out
    _check_gin(out)


@pytest.mark.slow
def test_plan_compiles_the_best_on_cpu_devices(capsys):
    assert plan.main([*SMALL_PLAN, "--target", "cpu", "--compile_top", "1"]) == 0
    out = capsys.readouterr().out
    assert "compiling 1/1" in out and "CPU compiler" in out  # memory says whose it is
    _check_gin(out)


@pytest.mark.slow  # the plan and its best candidates compiled for 32 GPUs, ~20 s
@GPU
def test_plan_compiles_the_best_for_the_a100_cluster(capsys, monkeypatch):
    """The best candidate's unrolled and scanned twins compiled (the analytic models cannot
    tell them apart), then ranked by the programs' rooflines plus exposed communication."""
    printed = []  # the compiled rows, as the table prints them
    table = plan._print_compiled
    monkeypatch.setattr(
        plan, "_print_compiled", lambda rows, *a: (printed.extend(rows), table(rows, *a))
    )
    argv = ["--model", "tiny", "--input_length", "128", "--target_length", "16"]
    argv += ["--batch_sizes", "64", "--show", "3", "--compile_top", "2"]
    assert plan.main(argv) == 0  # default target: 8 nodes x 4 A100-80GB
    out = capsys.readouterr().out
    assert "compiling 2/2" in out and "the GPU buffer assignment" in out
    # The progress line is whole before the compile (XLA warns on stderr while it runs).
    assert re.search(r"^compiling 1/2: [^\n]+\n  [\d.]+ GiB/dev, estimated [\d.]+ ", out, re.M)
    first, second = re.findall(r"^compiling \d/2: (.+)$", out, re.M)
    assert first.replace(" unrolled", "") == second and first != second
    assert "8 nodes x 4 GPUs, 80 GiB, 312 TFLOP/s" in out and "roof s" in out
    assert len(printed) == 2
    for row in printed:  # the roofline as scheduled: the kernels, then what waits on the network
        roof = row["roofline"]
        assert roof.compute > 0 and 0 <= roof.comm <= row["time"].comm and roof.bubble == 0
        assert plan._seconds(row) == roof.compute + roof.comm + roof.host
    assert plan._seconds(printed[0]) <= plan._seconds(printed[1])
    best = out.split("best, as gin flags:")[1]
    assert best.index(printed[0]["estimate"].candidate.gin()) < best.index(
        printed[1]["estimate"].candidate.gin()
    )
    assert "--gin.DataConfig.batch_size=64" in best
    assert best.count("--gin.LongT5Config.scan_layers=False") == 1


def test_a_surprise_in_one_layer_forms_memory_passes_over_only_that_form(monkeypatch, capsys):
    """After a compile holds more than the analytic model said, candidates of the same layer
    form (scanned or unrolled) that would then not fit are passed over, and the other form's
    are not: XLA's unrolled programs outgrow the scanned-calibrated model at large sizes."""
    gib = 2**30
    ratio = {False: 2.0, True: 1.1}  # compiled / estimated, unrolled and scanned

    def compiled(estimate, *_):
        total = estimate.memory * ratio[estimate.candidate.scan_layers]
        time = cost.StepTime(1.0, 0.0, 0.0)
        memory = types.SimpleNamespace(total=total)
        return dict(
            estimate=estimate, memory=memory, roofline=time, time=time, fits=total <= 80 * gib
        )

    monkeypatch.setattr(plan, "_compile", compiled)
    base = candidates.Candidate(1, 1, 1, 0, 0, 1, "none", 2)
    ranked = [
        candidates.Estimate(dataclasses.replace(base, remat=r, scan_layers=s), m * gib, None)
        for r, m in (("none", 40), ("save_dots", 50))
        for s in (False, True)
    ]
    args = types.SimpleNamespace(
        input_length=16384, target_length=512, compile_top=3, optimizer="adamw"
    )
    cluster = cost.Cluster(nodes=1, gpus_per_node=1, memory_gib=80)
    rows = plan._compile_best(args, None, cluster, [], ranked)
    labels = re.findall(r"^compiling \d/3: (.+)$", capsys.readouterr().out, re.M)
    assert labels == [ranked[i].candidate.label() for i in (0, 1, 3)]  # 50 x 2.0 > 80
    assert [r["fits"] for r in rows] == [True, True, True]


def test_a_gpu_target_without_the_gpu_extra_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(targets, "have_gpu_compiler", lambda: False)
    assert plan.main([*SMALL_PLAN, "--target", "h100-80gb", "--compile_top", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e '.[gpu]'" in err and "--target cpu" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "huge"], "unknown LongT5 preset 'huge'"),
        (["--nodes", "0"], "argument --nodes: expected an integer >= 1, got 0"),
        (["--model", "tiny", "--nodes", "1", "--gpus_per_node", "3", "--batch_sizes", "16"],
         "no data x tensor x pipeline layout of 3 devices"),
        (["--attention", "sparse"], "LongT5Config.attention='sparse'"),
        (["--target", "v100"], f"--target 'v100': expected cpu, one of {targets.names()}"),
        (["--target", "v100-32gb", "--dtype", "bfloat16"], NO_BF16),
        (["--offload", "disk"], "--offload disk: expected some of ('none', 'optimizer'"),
        (["--target", "v100-32gb", "--attention_kernel", "pallas"],
         "--attention_kernel pallas: the fused kernels compile for GPUs of compute capability 8.0 "
         "and newer, not v100-32gb; use auto or xla"),
    ],
)  # fmt: skip
def test_plan_bad_input_is_one_line(argv, message, capsys):
    assert plan.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_candidates_divide_everything():
    config = LongT5Config.preset("base", "tglobal")
    found = candidates.enumerate_candidates(config, 32, 4, [128])
    assert found and all(c.data * c.tensor * c.pipeline == 32 for c in found)
    assert all(c.tensor <= 4 and 12 % c.tensor == 0 for c in found)
    assert all(12 % (c.pipeline * c.repeats) == 0 for c in found)
    assert all(128 % (c.data * max(c.microbatches, 1)) == 0 for c in found)
    assert {c.zero_stage for c in found} == {0, 1, 2, 3}
    # ZeRO splits over data alone: one data rank runs one program at every stage.
    one = candidates.enumerate_candidates(config, 1, 1, [2])
    assert {c.zero_stage for c in one} == {0} and {c.scan_layers for c in one} == {False, True}
    # Unrolled layers without a pipeline, each just before its scanned twin.
    assert all(c.scan_layers for c in found if c.pipeline > 1)
    unrolled = [i for i, c in enumerate(found) if not c.scan_layers]
    assert unrolled and all(c.pipeline == 1 for c in (found[i] for i in unrolled))
    twins = [dataclasses.replace(found[i], scan_layers=True) for i in unrolled]
    assert twins == [found[i + 1] for i in unrolled]
    assert "--gin.LongT5Config.scan_layers=False" in found[unrolled[0]].gin()
    assert "unrolled" in found[unrolled[0]].label() and "unrolled" not in twins[0].label()
    # Parameters cast where used on data parallelism with ZeRO-2 (as dp32_zero2.gin), once a
    # step elsewhere; the flag is said only where it is not the default.
    casts = {(c.zero_stage, c.tensor, c.pipeline): c.cast_params for c in found}
    assert casts[2, 1, 1] == "at_use" and {casts[z, 1, 1] for z in (0, 1, 3)} == {"once"}
    assert {v for (z, t, p), v in casts.items() if t * p > 1} == {"once"}
    flag = "--gin.LongT5Config.cast_params=\"'at_use'\""
    assert all((flag in c.gin()) == (c.cast_params == "at_use") for c in found)


def test_targets_carry_their_figures(tmp_path):
    a100, h100 = targets.load("a100-80gb"), targets.load("h100-80gb")
    assert (a100.memory_gib, a100.hbm_gbps, a100.figures.peak_tflops) == (80.0, 2039.0, 312.0)
    assert h100.figures.peak_tflops == 989.0 and h100.hbm_gbps == pytest.approx(3352.32)
    assert not targets.load("cpu").is_gpu and targets.load("cpu").figures == a100.figures
    # A user's own description (XLA's format): an A100 with 40 GB.
    own = tmp_path / "a100-40gb.txtpb"
    own.write_text(a100.spec.replace("85899345920", str(40 * 2**30)))
    assert targets.load(str(own)).memory_gib == 40.0
    own.write_text("gpu_device_info { core_count: 1 }")
    with pytest.raises(ValueError, match="no cuda_compute_capability"):
        targets.load(str(own))
    # XLA's own files may leave the minor version out (a proto default); a Pascal has no figures.
    own.write_text(a100.spec.replace("major: 8 minor: 0", "major: 8"))
    assert targets.load(str(own)).compute_capability == "8.0"
    own.write_text(a100.spec.replace("major: 8", "major: 6"))
    with pytest.raises(ValueError, match=r"capability 6.x has no figures here \(7, 8 or 9\)"):
        targets.load(str(own))


def test_the_v100_target_has_its_figures_and_computes_in_float16():
    v100 = targets.load("v100-32gb")
    assert (v100.memory_gib, v100.hbm_gbps, v100.compute_capability) == (32.0, 900.0, "7.0")
    assert v100.figures == targets.Figures(125.0, 150.0, 12.5, 12.5, 15.7)
    assert v100.description == "Tesla V100-SXM2-32GB" and v100.is_gpu
    halves = {name: targets.load(name).half_dtype for name in [*targets.names(), "cpu"]}
    assert halves == {
        "a100-80gb": "bfloat16",
        "h100-80gb": "bfloat16",
        "h200-141gb": "bfloat16",
        "v100-32gb": "float16",
        "cpu": "bfloat16",
    }
    assert v100.dtype(None) == "float16" and v100.dtype("float32") == "float32"
    with pytest.raises(ValueError, match="has no bfloat16"):
        v100.dtype("bfloat16")


def test_the_h200_target_is_the_h100s_chip_with_its_memory():
    """The GPU the measured steps ran on: every field XLA is told as the H100's but the HBM's
    size and bandwidth (the data sheet's 4.8 TB/s; 143,771 MiB as its driver reports)."""
    h100, h200 = targets.load("h100-80gb"), targets.load("h200-141gb")
    assert (h200.hbm_gbps, h200.memory_gib * 2**10) == (4800.0, 143_771.0)
    assert (h200.figures, h200.compute_capability) == (h100.figures, h100.compute_capability)
    assert h200.description == "NVIDIA H200"
    differ = ("memory_bandwidth", "device_memory_size", "device_description_str")

    def fields(target):
        lines = (x.strip() for x in target.spec.splitlines() if not x.startswith("#"))
        return [x for x in lines if not x.startswith(differ)]

    assert fields(h200) == fields(h100)


def test_a_float32_plan_computes_at_float32s_peak_with_xlas_attention_on_an_a100(capsys):
    """TF32's dense peak (an A100's 156 TFLOP/s, half its bfloat16 312; an H100's 494.5; a
    V100's CUDA cores 15.7), unless --peak_tflops says; and `auto` keeps float32 off the kernels
    on compute capability 8.x (`kernels.backend.suits`), not on 9.0."""
    a100, h100, v100 = (targets.load(n) for n in ("a100-80gb", "h100-80gb", "v100-32gb"))
    assert [t.figures.peak("float32") for t in (a100, h100, v100)] == [156.0, 494.5, 15.7]
    assert [t.figures.peak("bfloat16") for t in (a100, h100)] == [312.0, 989.0]
    args = plan._parser().parse_args(["--target", "a100-80gb", "--dtype", "float32"])
    assert cost.Cluster.from_args(a100, args).peak_tflops == 156.0
    args.peak_tflops = 100.0
    assert cost.Cluster.from_args(a100, args).peak_tflops == 100.0
    for target, kernel, peak in (("a100-80gb", "xla", 156), ("h100-80gb", "pallas", 494.5)):
        argv = [*SMALL_PLAN, "--target", target, "--dtype", "float32", "--compile_top", "0"]
        assert plan.main(argv) == 0
        out = capsys.readouterr().out
        assert f"float32 128/16 attention_kernel={kernel} on 1 nodes x 8 GPUs" in out
        assert f"GiB, {peak:g} TFLOP/s peak" in out


def _gpu(kind: str, capability: str):
    """What a jax CUDA device says of itself, as far as the dtype check reads it."""
    return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=capability)


def test_a_run_refuses_bfloat16_on_devices_without_it():
    v100 = _gpu("Tesla V100-SXM2-32GB", "7.0")
    with pytest.raises(ConfigError) as e:
        local.check_dtype("bfloat16", v100)
    assert str(e.value) == (
        "LongT5Config.dtype='bfloat16': Tesla V100-SXM2-32GB (compute capability 7.0) has no "
        "bfloat16; use 'float16' (or 'float32')"
    )
    for dtype in ("float16", "float32"):
        local.check_dtype(dtype, v100)
    local.check_dtype("bfloat16", _gpu("NVIDIA A100-SXM4-80GB", "8.0"))
    local.check_dtype("bfloat16", _gpu("AMD Instinct MI250X", "gfx90a"))  # ROCm: not CUDA's rule
    local.check_dtype("bfloat16", jax.devices()[0])  # the test's CPU devices
    with pytest.raises(ConfigError, match=r"Quadro RTX 6000 \(compute capability 7.5\)"):
        local.check_dtype("bfloat16", _gpu("Quadro RTX 6000", "7.5"))
    # What the benchmarks compile in for a device: its half precision.
    assert local.half_dtype(v100) == "float16"
    assert local.half_dtype(_gpu("NVIDIA A100-SXM4-80GB", "8.0")) == "bfloat16"
    assert local.half_dtype(jax.devices()[0]) == "bfloat16"


@GPU
def test_compile_only_v100s_say_their_capability_as_real_ones_do():
    """The check reads a device's `compute_capability`: the compile-only V100 has it too."""
    (device,) = targets.devices(targets.load("v100-32gb"), 1, 1)
    assert (device.device_kind, device.compute_capability) == ("Tesla V100-SXM2-32GB", "7.0")
    with pytest.raises(ConfigError, match="has no bfloat16"):
        local.check_dtype("bfloat16", device)


@GPU
def test_compile_only_gpus_sit_on_their_nodes():
    devices = targets.devices(targets.load("a100-80gb"), 8, 4)
    assert len(devices) == 32 and devices[0].platform == "gpu"
    assert node_of(devices, 4) == [d // 4 for d in range(32)]


def test_cpu_devices_fill_nodes_in_order():
    devices = jax.devices()  # the test process's 8 fake CPU devices, one process
    assert node_of(devices, 4) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert node_of(devices[::-1], 2) == [3, 3, 2, 2, 1, 1, 0, 0]


def test_gpu_specs_ship_with_the_package():
    """Installed (not editable) copies carry the descriptions: pyproject names them as data."""
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (pattern,) = project["tool"]["setuptools"]["package-data"]["longt5_jax.estimate"]
    assert sorted(p.name for p in targets.SPECS.glob(pattern.split("/")[-1])) == [
        "a100-80gb.txtpb",
        "h100-80gb.txtpb",
        "h200-141gb.txtpb",
        "v100-32gb.txtpb",
    ]
    assert (targets.SPECS.parent / pattern.split("/")[0]) == targets.SPECS


def test_the_memory_fit_minimises_the_worst_relative_error():
    """Samples made from known coefficients give them back; with one sample compiled 10% above
    them, the fit splits the difference between the two samples' errors."""

    def act(stash, scores, policy="full", logits=1.0):
        return memory_model.Activations(stash, scores, logits, policy)

    truth = (1.3, 12.0)
    acts = [act(10.0, 0.5), act(40.0, 0.1), act(5.0, 3.0), act(2.0, 0.0, "none")]
    samples = [(a, 4.0, 4.0 + a.bytes({"full": truth, "none": (0.7, 0.0)})) for a in acts]
    fitted = memory_model.fit(samples)
    assert fitted["full"] == pytest.approx(truth, rel=1e-6)
    assert fitted["none"] == pytest.approx((0.7, 0.0), abs=1e-6)
    # Stash alone, a = 2 exact for the first and 10% low for the second: errors a/2 - 1 and
    # 1 - a/2.2 are equal at a = 2 / (1/2 + 1/2.2) = 2.0952..., a worst error of 1/21.
    one = [(act(10.0, 0.0, logits=0.0), 0.0, 20.0), (act(20.0, 0.0, logits=0.0), 0.0, 44.0)]
    ((a, b),) = memory_model.fit(one).values()
    assert a == pytest.approx(2 / (1 / 2 + 1 / 2.2), rel=1e-6) and b == pytest.approx(0, abs=1e-6)


def test_the_planner_plans_the_kernels_for_gpus_and_says_so_in_the_gin(capsys):
    """--attention_kernel auto (the default): the fused kernels for a GPU target that compiles
    them, XLA's attention for a V100 (Triton compiles for Ampere on) and CPUs; the gin flags
    select what was planned."""
    for argv, kernel in (
        ([], "pallas"),
        (["--target", "v100-32gb"], "xla"),
        (["--target", "cpu"], "xla"),
        (["--attention_kernel", "xla"], "xla"),
    ):
        assert plan.main([*SMALL_PLAN, *argv, "--compile_top", "0"]) == 0
        out = capsys.readouterr().out
        assert f"attention_kernel={kernel} on " in out
        assert f"--gin.LongT5Config.attention_kernel=\"'{kernel}'\"" in out.split("gin flags:")[1]


def test_the_kernels_memory_keeps_their_outputs_and_no_scores():
    """With the fused kernels save_attention is a fourth candidate policy whose stash adds each
    kernel's output and log-sum-exp (the encoder's one, the decoder's two a layer), and no
    policy holds a score tensor; on XLA's path save_attention is full remat."""
    xla = LongT5Config.preset("xl", "tglobal", dtype="bfloat16")
    fused = dataclasses.replace(xla, attention_kernel="pallas")
    rows, tensor, lengths = 2.0, 4, (16384, 512)

    def act(config, remat):
        return memory_model.activations(config, lengths, rows, tensor, remat=remat)

    full, saved = act(fused, "full"), act(fused, "save_attention")
    per_token = 2 * 32 * 64 / tensor + 4 * 32 / tensor  # bf16 output, float32 log-sum-exp
    assert saved.stash - full.stash == pytest.approx(rows * per_token * 24 * (16384 + 2 * 512))
    assert (full.policy, saved.policy) == ("fused full", "fused save_attention")
    assert act(xla, "save_attention") == act(xla, "full")
    for remat in ("none", "full", "save_dots"):
        assert act(fused, remat).bytes() < act(xla, remat).bytes()
    remats = {
        c: {x.remat for x in candidates.enumerate_candidates(c, 32, 4, [128])} for c in (xla, fused)
    }
    assert remats[fused] == remats[xla] | {"save_attention"} and "save_attention" not in remats[xla]


def test_offload_is_a_candidate_dimension_with_its_memory_and_pcie_cost():
    """Offloading moves the optimizer state (and parameters) to the host and charges two PCIe
    crossings of those bytes per step; it never changes what the collectives move."""
    from longt5_jax.estimate.shapes import ModelShapes
    from longt5_jax.training.optim import OptimizerConfig, make_optimizer

    config = LongT5Config.preset("xl", "tglobal", dtype="bfloat16")
    found = candidates.enumerate_candidates(config, 32, 4, [128])
    assert {c.offload for c in found} == {"none", "optimizer", "optimizer_and_params"}
    assert "--gin.ParallelConfig.offload=\"'optimizer'\"" in next(
        c.gin() for c in found if c.offload == "optimizer"
    )
    shapes = ModelShapes.of(config, make_optimizer(OptimizerConfig(name="adamw")))
    cluster = cost.Cluster(host_gbps=20.0)
    base = candidates.Candidate(32, 1, 1, 0, 0, 1, "full", 128)
    none, opt, both = (
        candidates.estimate(dataclasses.replace(base, offload=m), shapes, (8192, 512), cluster)
        for m in ("none", "optimizer", "optimizer_and_params")
    )
    state = {m: candidates.state_bytes(e.candidate, shapes) for m, e in
             (("none", none), ("optimizer", opt), ("both", both))}  # fmt: skip
    adam = state["optimizer"]["host"]
    params = shapes.sharded_bytes(base.sizes, "params", 0)
    assert adam == pytest.approx(2 * params)  # AdamW: two float32 moments per parameter
    assert none.memory - opt.memory == pytest.approx(adam)
    assert state["both"]["host"] == pytest.approx(adam + params)
    assert opt.time.host == pytest.approx(2 * adam / 20e9) and none.time.host == 0
    assert opt.time.comm == none.time.comm
    # The update, once a step: offloaded it runs from the host's memory, no faster than HBM.
    update = candidates.update_seconds(base, shapes, cluster)
    assert update == pytest.approx((3 * params + 2 * adam) / (cluster.hbm_gbps * 1e9))
    assert candidates.update_seconds(opt.candidate, shapes, cluster) == update
    assert opt.time.total == pytest.approx(none.time.total + opt.time.host)


def test_the_update_paid_once_a_step_favours_larger_batches_on_one_gpu():
    """On one GPU no gradient reduction is paid a step, so without the optimizer update's HBM
    time every batch estimated alike per sample and the smallest (the least memory) was the one
    compiled: xl 4k on an H200, where 4 examples a step measured 36.5% MFU and 1 26.5%."""
    from longt5_jax.estimate.shapes import ModelShapes
    from longt5_jax.training.optim import OptimizerConfig, make_optimizer

    config = LongT5Config.preset("xl", "tglobal", dtype="bfloat16", attention_kernel="pallas")
    shapes = ModelShapes.of(config, make_optimizer(OptimizerConfig(name="adamw")))
    cluster = cost.Cluster.of(targets.load("h200-141gb"), 1, 1)
    per_sample = [
        candidates.estimate(c, shapes, (4096, 512), cluster).samples_per_s
        for c in candidates.enumerate_candidates(config, 1, 1, [1, 4, 8], ("none",))
        if c.remat == "save_dots" and c.scan_layers
    ]
    assert per_sample == sorted(per_sample) and per_sample[0] < per_sample[-1] * 0.95
