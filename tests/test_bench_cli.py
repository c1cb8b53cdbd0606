"""Every benchmark's command line: a bad --out_dir, no timed steps or a bad number is one line
naming the flag, exit 2, before any work."""

import sys

import pytest
from helpers import child_env, run_process

from longt5_jax.bench import __main__ as bench_main


@pytest.fixture(scope="module")
def env():
    """The compile settings of every process the tests start."""
    return child_env("JAX_PLATFORMS")


@pytest.mark.parametrize("name", sorted(bench_main.BENCHMARKS))
def test_every_benchmark_refuses_an_output_directory_before_any_work(name, tmp_path, capsys):
    """A file as --out_dir, or a directory under a file: one line before anything runs (the
    report would otherwise fail to be written after minutes of measuring)."""
    blocker = tmp_path / "report.json"
    blocker.write_text("{}")
    for out, why in (
        (blocker, f"{blocker} exists and is not a directory"),
        (blocker / "sub", f"{blocker}/sub cannot be made: {blocker} is not a writable directory"),
    ):
        assert bench_main.main([name, "--out_dir", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert err[0].startswith(f"error: python -m longt5_jax.bench {name}: argument --out_dir: ")
        assert why in err[0]
    assert blocker.read_text() == "{}"


@pytest.mark.parametrize("name", ["device", "pipeline", "strategy"])
def test_a_benchmark_with_no_timed_steps_is_refused_before_any_work(name, capsys):
    assert bench_main.main([name, "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: python -m longt5_jax.bench {name}: argument --steps: expected an integer >= 1, "
        "got 0 (see --help)"
    ]


def test_bench_speed_refuses_a_negative_batch_in_one_line(tmp_path, env):
    """`bench speed --batch_size=-2` (an IndexError traceback once): one line, exit 2, before
    any work."""
    command = [sys.executable, "-m", "longt5_jax.bench", "speed", "--batch_size=-2"]
    done = run_process([*command, f"--out_dir={tmp_path}"], env)
    assert (done.returncode, done.stderr) == (
        2,
        "error: python -m longt5_jax.bench speed: argument --batch_size: expected an integer "
        ">= 1, got -2 (see --help)\n",
    )
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "args,line",
    [
        (
            ["speed", "--settle_steps=-1"],
            "speed: argument --settle_steps: expected an integer >= 0",
        ),
        (["decode", "--beams", "0"], "decode: argument --beams: expected an integer >= 1, got 0"),
        (["offload", "--zero", "4"], "offload: argument --zero: invalid choice: 4"),
        (["cluster", "--batch_size=0"], "cluster: argument --batch_size: expected an integer >= 1"),
        (["strategy", "--efficiency=1.5"], "strategy: argument --efficiency: expected a number in"),
        (["cluster", "--nodes=0"], "cluster: argument --nodes: expected an integer >= 1, got 0"),
        (["memory", "--gpus_per_node=x"], "memory: argument --gpus_per_node: expected an integer"),
    ],
)
def test_a_benchmark_refuses_a_bad_number_in_one_line(tmp_path, capsys, args, line):
    """A negative step count, a beam count of 0, a ZeRO stage that does not exist, an
    efficiency over 1: one line naming the flag, exit 2, before any work."""
    assert bench_main.main([*args, f"--out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: python -m longt5_jax.bench {line}") and err.count("\n") == 1
    assert not list(tmp_path.iterdir())
