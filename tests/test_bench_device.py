"""launch/gpu_check.sh without a GPU: stubs of python3 and nvidia-smi on PATH record what it would
run, so the order of a lease's work, its budget and its launch bookkeeping are checked here (a
broken script is found before it spends device time)."""

import os
import shlex
import subprocess
from pathlib import Path

from longt5_jax.bench.device import parse_launch
from longt5_jax.kernels.launch import kernels_set_by

SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "gpu_check.sh"
SPLIT = "decoder_attention_fwd=4:2:4,decoder_attention_dq=8:2:4"
GOALS = "base:16384:2:save_attention xl:4096:1:save_dots"


def _dry_run(tmp_path: Path, best: str = "", **env) -> tuple[list[tuple], str]:
    """(what each benchmark was asked: (bench, case or cases, kernel, launch, layers or
    optimizer where not the scan and AdamW), the log)."""
    stubs, calls = tmp_path / "bin", tmp_path / "calls"
    stubs.mkdir(parents=True)
    python = f'#!/usr/bin/env bash\n{{ printf "%q " "$@"; echo; }} >> {calls}\n'
    python += f'case "$*" in *best_launch*) echo "{best}";; esac\n'  # the best launch, as read
    for name, text in (("python3", python), ("nvidia-smi", "#!/usr/bin/env bash\necho H100\n")):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "GPU_CHECK_OUT": str(out), **env}
    subprocess.run(["bash", str(SCRIPT)], env=env, check=True, capture_output=True, timeout=60)
    asked = []
    for line in calls.read_text().splitlines():
        words = shlex.split(line)
        if words[:2] != ["-m", "longt5_jax.bench"]:
            continue
        arg = {w: words[i + 1] if i + 1 < len(words) else "" for i, w in enumerate(words)}
        layers = "unrolled" if "--no-scan_layers" in words else ""
        if arg.get("--optimizer", "adamw") != "adamw":
            layers = arg["--optimizer"]
        cases = " ".join(words[words.index("--cases") + 1 :]) if "--cases" in words else ""
        case = cases.split(" --")[0] if "--cases" in words else arg.get("--preset", "")
        asked.append(
            (words[2], case, arg.get("--attention_kernel", ""), arg.get("--launch"), layers)
        )
        if words[2] == "device":  # every step reads back the earlier steps' autotuning
            assert arg["--autotune_cache"] == str(out / "autotune")
    assert (tmp_path / "out.tar.gz").exists()  # packed whatever happened
    return asked, (out / "log.txt").read_text()


def test_a_lease_times_the_kernels_then_each_goal_with_the_fastest_then_a_full_batch(tmp_path):
    asked, log = _dry_run(tmp_path, best=SPLIT, CASES=f"{GOALS} base:4096:4:none")
    kernels = asked[0]
    assert kernels[0] == "kernels" and kernels[3] == ""  # the default is the one checked
    # Every setting the lease tries parses, and each sets some kernel (a bad one would cost the
    # lease its whole kernels step).
    calls = (tmp_path / "calls").read_text().splitlines()
    words = shlex.split(next(line for line in calls if "longt5_jax.bench kernels" in line))
    settings = words[words.index("--launch") + 2 :]  # after the default, ""
    assert len(settings) >= 4 and "encoder_attention_fwd=8:2:1:64" in settings
    assert all(kernels_set_by(parse_launch(s)) for s in settings)
    steps = [a for a in asked if a[0] == "device"]
    base, xl = GOALS.split()
    assert steps == [
        ("device", base, "pallas", "", ""),
        ("device", base, "pallas", SPLIT, ""),
        ("device", xl, "pallas", "", ""),
        ("device", xl, "pallas", SPLIT, ""),
        # base 16k where the roofline ranks it best: no matmul rerun, no scan's copies
        ("device", "base:16384:2:none", "pallas", SPLIT, "unrolled"),
        ("device", "base:16384:8:none", "pallas", SPLIT, "unrolled"),
        ("device", "base:16384:2:save_dots", "pallas", SPLIT, "unrolled"),
        ("device", "xl:4096:8:save_attention", "pallas", SPLIT, ""),  # a batch that fills it
        ("device", "xl:4096:4:save_dots", "pallas", SPLIT, ""),
        ("device", base, "pallas", SPLIT, "adafactor"),  # the training loop's optimizer
        ("device", xl, "pallas", SPLIT, "adafactor"),
        ("device", "base:16384:2:full", "xla", "", ""),  # save_attention is full remat's program
        ("device", xl, "xla", "", ""),
        ("device", "base:4096:4:none", "pallas", SPLIT, ""),
        ("device", "base:4096:4:none", "pallas", SPLIT, "unrolled"),
        ("device", "base:4096:4:none", "xla", "", ""),
        ("device", base, "pallas", SPLIT, ""),  # transformers' step beside ours
        ("device", base, "pallas", SPLIT, "unrolled"),
        ("device", xl, "pallas", SPLIT, "unrolled"),
    ]
    assert [a[:2] for a in asked if a[0] == "profile"] == [("profile", "base")]
    # Beside jax's own flash attention once, after the goal cases' launch step.
    benches = [a[0] for a in asked]
    assert benches.count("headroom") == 1
    assert benches.index("headroom") == benches.index("device") + 4
    # Then base 16k's step broken down by kind (never done since its kernels changed), before
    # the batches and optimizers a lease has measured.
    assert benches.index("profile") == benches.index("headroom") + 1
    assert "skipped" not in log
    # The trainer as users run it, once, after XLA's goal cases: the run file's "auto".
    calls = (tmp_path / "calls").read_text().splitlines()
    (train,) = [i for i, line in enumerate(calls) if line.startswith("-m longt5_jax.train ")]
    assert "--gin_file=configs/runs/pretrain.gin" in calls[train]
    assert "--attention_kernel xla" in calls[train - 1] and "base:4096:4:none" in calls[train + 1]


def test_each_step_is_measured_once_and_nothing_runs_past_the_budget(tmp_path):
    asked, _ = _dry_run(tmp_path / "a", STEPS="goals launch", CASES=GOALS)
    # No launch faster than the default was found: each goal case once, with the default.
    assert asked == [("device", case, "pallas", "", "") for case in GOALS.split()]
    asked, log = _dry_run(tmp_path / "b", BUDGET="0", CASES=GOALS)
    assert asked == [] and "skipped (no time left): python3 -m longt5_jax.bench kernels" in log
