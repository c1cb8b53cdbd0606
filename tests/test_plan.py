"""The planner ranks candidates, compiles the best on the test's 8 fake devices, prints the gin
flags that select them, and turns bad input into one line and exit status 2."""

import pytest

from longt5_jax.model import LongT5Config
from longt5_jax.plan import candidates
from longt5_jax.plan import planner as plan

SMALL = ["--model", "tiny", "--nodes", "1", "--gpus_per_node", "8", "--input_length", "128"]
SMALL += ["--target_length", "16", "--batch_sizes", "16", "--show", "3"]


def _check_gin(out: str) -> None:
    best = out.split("best, as gin flags:")[1]
    assert "--gin.MeshConfig.data=" in best and "--gin.MeshConfig.zero_stage=" in best
    assert "--gin.LongT5Config.remat=" in best and "--gin.DataConfig.batch_size=16" in best


def test_plan_ranks_and_prints_gin(capsys):
    assert plan.main([*SMALL, "--compile_top", "0"]) == 0
    out = capsys.readouterr().out
    assert "candidates divide" in out and "est GiB/dev" in out and "compiling" not in out
    _check_gin(out)


@pytest.mark.slow
def test_plan_compiles_the_best(capsys):
    assert plan.main([*SMALL, "--compile_top", "1"]) == 0
    out = capsys.readouterr().out
    assert "compiling 1/1" in out and "CPU compiler" in out  # memory says whose it is
    _check_gin(out)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "huge"], "unknown LongT5 preset 'huge'"),
        (["--nodes", "0"], "cluster nodes=0"),
        (["--model", "tiny", "--nodes", "1", "--gpus_per_node", "3", "--batch_sizes", "16"],
         "no data x tensor x pipeline layout of 3 devices"),
        (["--attention", "sparse"], "LongT5Config.attention='sparse'"),
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
