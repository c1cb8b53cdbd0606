"""`bench kernels`: the launch settings it picks for the step, and the report it writes (its
kernels within the tolerance of the XLA path, each setting timed)."""

import json

import pytest
from helpers import TOLERANCE

from longt5_jax.bench import kernels
from longt5_jax.kernels import call
from longt5_jax.kernels import launch as kernel_launch


def test_the_step_runs_every_setting_that_beat_the_default_where_they_set_other_kernels():
    """`bench kernels`' launch for the step: each setting faster than the default over the
    cases, most gained first, none setting a kernel an earlier one sets; the rest left out."""
    dec, tg, local = (
        "decoder_attention_fwd=4:2:4",
        "encoder_attention_dq=4:3:2",
        "encoder_local_*=8:3",
    )
    family = "encoder_*=8:2"  # sets TGlobal's dq too and gains less than `tg`: left out
    seconds = [  # a TGlobal, a Local and a decoder layer under each setting
        {"": 7.67, dec: 7.67, tg: 7.40, local: 7.67, family: 7.50},
        {"": 1.78, dec: 1.78, tg: 1.78, local: 1.95, family: 1.77},
        {"": 1.84, dec: 1.60, tg: 1.84, local: 1.84, family: 1.84},
    ]
    reports = [{"launch_seconds": s} for s in seconds]
    assert kernels._best_launch(reports) == f"{tg},{dec}"

    def set_by(launch):
        return kernel_launch.kernels_set_by(kernels.parse_launch(launch))

    assert set_by(family) >= set_by(tg) == {"encoder_attention_dq"}
    # Traced, a case's layer is its kernels' device time: the calls' time, which counts the
    # host's dispatch, varies by more than a setting gains (an H200's, 2026-11-28: the TGlobal
    # layer's calls took longest under the decoder's dkv setting, which left its kernels as
    # they were, and hid that setting's 16% of the decoder layer's kernels).
    dkv = "decoder_attention_dkv=4:2"

    def traced(calls_ms, kernels_ms, first):
        kernels = {x: [{"kernel": "k", "ms": ms / 2}] * 2 for x, ms in kernels_ms.items()}
        return {"launch_seconds": {x: ms / 1e3 for x, ms in calls_ms.items()}, "launch": first,
                "pallas_kernels": kernels.pop(first), "launch_kernels": kernels}  # fmt: skip

    lease = [
        traced({dec: 7.52, tg: 7.68, dkv: 7.71, "": 7.49},
               {dec: 6.568, tg: 6.615, dkv: 6.558, "": 6.567}, dec),
        traced({dec: 1.88, tg: 1.84, dkv: 2.11, "": 1.97},
               {dec: 1.292, tg: 1.291, dkv: 1.293, "": 1.293}, dec),
        traced({dec: 1.64, tg: 1.84, dkv: 1.62, "": 1.75},
               {dec: 0.851, tg: 0.894, dkv: 0.753, "": 0.893}, dec),
    ]  # fmt: skip
    assert kernels._best_launch(lease) == f"{dkv},{dec}"
    untraced = [{k: v for k, v in r.items() if k == "launch_seconds"} for r in lease]
    assert kernels._best_launch(untraced) == dec  # by the calls' time, as that lease chose
    slower = [{"launch_seconds": {"": 1.0, dec: 1.1}}]
    assert kernels._best_launch(slower) == ""  # nothing beat the default
    assert kernels._best_launch([{"launch_seconds": {dec: 2.0, tg: 1.0}}]) == tg  # no default
    assert kernels._best_launch([{}]) is None
    # A setting that sets none of a case's kernels is not timed there (its layer is the first
    # setting's program) and counts as the first's time.
    tglobal, decoder = "base:tglobal:16384:2:padded", "base:decoder:4096:2:padded"
    assert not set_by(dec) & kernels.family(tglobal) and set_by(dec) <= kernels.family(decoder)
    assert set_by(tg) <= kernels.family(tglobal) and not set_by(tg) & kernels.family(decoder)
    assert not set_by(local) & kernels.family(tglobal)
    skipped = [
        {"launch_seconds": {"": 7.67, tg: 7.40}, "launch": "", "launch_as_first": [dec]},
        {"launch_seconds": {"": 1.84, dec: 1.60}, "launch": "", "launch_as_first": [tg]},
    ]
    assert kernels._best_launch(skipped) == f"{tg},{dec}"
    with pytest.raises(ValueError, match="'encoder_attention_dx' is not one of"):
        call.call(
            None,
            "encoder_attention_dx",
            flops=0,
            grid=(1,),
            in_specs=[],
            out_specs=[],
            out_shape=[],
        )


def test_bench_kernels_keeps_the_cases_it_timed_when_stopped(tmp_path, monkeypatch):
    """kernels.json is written after each case: a run its time limit stops keeps the launch
    for the step from the cases it finished."""
    timed = iter([{"case": "first", "launch_seconds": {"": 2.0, "*=8:1": 1.0}}])

    def measure(case, *_):
        return next(timed)  # the second case never ends: StopIteration

    monkeypatch.setattr(kernels, "measure", measure)
    cases = ["tiny:tglobal:150:1:packed", "tiny:decoder:70:1:padded"]
    with pytest.raises(StopIteration):
        kernels._main(["--cases", *cases, "--launch", "*=8:1", "", "--out_dir", str(tmp_path)])
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert [c["case"] for c in report["cases"]] == ["first"]
    assert report["best_launch"] == "*=8:1"


@pytest.mark.slow
def test_bench_kernels_checks_both_families_and_times_launch_settings(tmp_path):
    """`bench kernels` on CPU (interpreted): the encoder and decoder layers' float32 kernels
    within the tolerance of the XLA path, each launch setting timed (and traced: the first
    setting's kernels are `pallas_kernels`, each other's its own), the fastest named."""
    cases = ["tiny:tglobal:150:1:packed", "tiny:decoder:70:1:padded"]
    launches = ["", "*=8:1"]
    args = ["--cases", *cases, "--repeats", "1", "--launch", *launches, "--out_dir", str(tmp_path)]
    assert kernels.main([*args, "--trace"]) == 0
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert [c["case"] for c in report["cases"]] == cases
    for case in report["cases"]:
        assert max(case["pallas_float32"].values()) <= TOLERANCE, case
        assert set(case["launch_seconds"]) == set(launches)
        assert set(case["launch_kernels"]) == {"*=8:1"}
    assert report["best_launch"] in launches
    assert kernels.main(["--launch", "*=3:2"]) == 2  # 3 warps: one line, no work
