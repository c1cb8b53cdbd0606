"""Bad input at every command, as a new user meets it: each case runs the real command in a
process of its own and must end with one line on stderr naming the culprit, exit 2, no
traceback, and every file that existed before exactly as it was.

The commands start together, forked from one process that imported them (`run_forked`: each
is mostly Python and jax start-up), so the whole table costs about as much as its slowest case.
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY_RUN, child_env, run_forked

from longt5_jax.data.pipeline import DataConfig, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
# The demo at test sizes; the tokenizer is the one the fixture trains (cached for every process).
TRAIN = [
    "-m",
    "longt5_jax.train",
    "--gin_file=configs/demo.gin",
    "--gin.DataConfig.input_length=256",
    "--gin.DataConfig.target_length=32",
    "--gin.DataConfig.tokenizer_vocab_size=2000",
    "--gin.LongT5Config.vocab_size=2176",
]
FILES = ["--gin.DataConfig.task='files'"]


def _train(*args: str) -> list[str]:
    return [*TRAIN, "--gin.MODEL_DIR='{d}/run'", *args]


# name: (command line with {d} for the case's directory, what the one line must name)
CASES = {
    "mistyped data glob": (
        _train(
            *FILES, "--gin.DataConfig.train_files=['{d}/data/docs.jsonl', '{d}/data/trian-*.jsonl']"
        ),
        "no files match '{d}/data/trian-*.jsonl'",
    ),
    "data files as one comma-joined string": (
        _train(*FILES, "--gin.DataConfig.train_files='{d}/data/docs.jsonl,{d}/data/empty.jsonl'"),
        "DataConfig.train_files = '{d}/data/docs.jsonl,{d}/data/empty.jsonl': expected a list of "
        "str: write ['{d}/data/docs.jsonl', '{d}/data/empty.jsonl']",
    ),
    "malformed JSONL": (
        _train(*FILES, "--gin.DataConfig.train_files='{d}/data/malformed.jsonl'"),
        "{d}/data/malformed.jsonl:2: not valid JSON",
    ),
    "empty JSONL": (
        _train(*FILES, "--gin.DataConfig.train_files='{d}/data/empty.jsonl'"),
        "{d}/data/empty.jsonl: no records",
    ),
    "corrupt Parquet": (
        _train(*FILES, "--gin.DataConfig.train_files='{d}/data/corrupt.parquet'"),
        "{d}/data/corrupt.parquet: not a readable Parquet file",
    ),
    "missing tokenizer": (
        _train("--gin.DataConfig.tokenizer='{d}/data/missing.model'"),
        "{d}/data/missing.model: SentencePiece model not found",
    ),
    "corrupt tokenizer": (
        _train("--gin.DataConfig.tokenizer='{d}/data/corrupt.model'"),
        "{d}/data/corrupt.model: not a SentencePiece model",
    ),
    "MODEL_DIR is a file": (
        [*TRAIN, "--gin.MODEL_DIR='{d}/data/empty.jsonl'"],
        "MODEL_DIR='{d}/data/empty.jsonl': a file, expected a directory",
    ),
    "metrics port out of range": (
        _train("--gin.RunConfig.prometheus_port=70000"),
        "RunConfig.prometheus_port=70000: expected a port in 0-65535",
    ),
    "gin syntax error": (
        _train("--gin.LongT5Config.d_model=(("),
        "--gin.LongT5Config.d_model=((: not valid gin",
    ),
    "predict --max_length 0": (
        ["-m", "longt5_jax.predict", "--checkpoint={d}/run", "--input={d}/data/docs.jsonl"]
        + ["--output={d}/out.jsonl", "--max_length=0"],
        "argument --max_length: expected an integer >= 1, got 0",
    ),
    "predict --output a directory": (
        ["-m", "longt5_jax.predict", "--checkpoint={d}/run", "--input={d}/data/docs.jsonl"]
        + ["--output={d}/data"],
        "argument --output: {d}/data is a directory",
    ),
    "data.preview mistyped glob": (
        ["-m", "longt5_jax.data_preview", "--gin_file=configs/demo.gin", *FILES]
        + ["--gin.DataConfig.train_files='{d}/data/trian-*.jsonl'"],
        "no files match '{d}/data/trian-*.jsonl'",
    ),
    "data.convert mistyped glob": (
        ["-m", "longt5_jax.data_convert", "--input={d}/data/trian-*.jsonl"]
        + ["--output_dir={d}/shards"],
        "no files match '{d}/data/trian-*.jsonl'",
    ),
    "evaluate without a gin file": (
        ["-m", "longt5_jax.evaluate", "--checkpoint={d}/data"],
        "{d}/data",
    ),
    "ckpt of a file": (
        ["-m", "longt5_jax.ckpt", "tree", "{d}/data/docs.jsonl"],
        "{d}/data/docs.jsonl",
    ),
    "plan of an unknown model": (
        ["-m", "longt5_jax.plan", "--model=huge"],
        "huge",
    ),
    "bench of an unknown benchmark": (
        ["-m", "longt5_jax.bench", "speeed"],
        "benchmark 'speeed': expected one of",
    ),
    "launch.local with no processes": (
        ["-m", "longt5_jax.launch.local", "--num_processes=0", "--", "--gin_file=x"],
        "argument --num_processes: expected an integer >= 1, got 0",
    ),
}


def _prepare(d: Path) -> None:
    """A case's directory: the inputs every case may name, and nothing else."""
    data = d / "data"
    data.mkdir(parents=True)
    (data / "malformed.jsonl").write_text('{"article": "a b", "abstract": "c"}\n{"article": "a')
    (data / "empty.jsonl").write_text("")
    (data / "corrupt.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 4)
    (data / "corrupt.model").write_bytes(bytes(range(256)) * 4)
    (data / "docs.jsonl").write_text('{"id": "1", "article": "one short document"}\n')


def _snapshot(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
    }


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A data cache holding the tests' tokenizer, trained once for every process."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LONGT5_JAX_CACHE", str(cache))
        load_tokenizer(DataConfig(tokenizer_vocab_size=2000))
        yield cache


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, cache):
    """Every case run at once; each result with its directory's files before and after."""
    env = {**os.environ, "LONGT5_JAX_CACHE": str(cache)}
    cases = {}
    for i, (name, (argv, _)) in enumerate(CASES.items()):
        d = tmp_path_factory.mktemp(f"case{i}")
        _prepare(d)
        cases[name] = (d, [sys.executable, *(a.format(d=d) for a in argv)], _snapshot(d))
    done = run_forked([c for _, c, _ in cases.values()], env, ROOT)
    return {
        name: (d, proc.returncode, proc.stdout, proc.stderr, before, _snapshot(d))
        for (name, (d, _, before)), proc in zip(cases.items(), done, strict=True)
    }


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(outcomes, name):
    d, rc, out, err, before, after = outcomes[name]
    lines = err.strip().splitlines()
    assert "Traceback" not in err + out, err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and CASES[name][1].format(d=d) in lines[0], lines[0]
    assert rc == 2, (rc, err)
    assert after == before


def test_data_preview_needs_no_model_dir(cache):
    """The demo's config requires a MODEL_DIR for training; previewing its data does not."""
    from longt5_jax import data_preview as preview

    argv = [f"--gin_file={ROOT / 'configs/demo.gin'}", "--gin.DataConfig.input_length=256"]
    argv += ["--gin.DataConfig.tokenizer_vocab_size=2000", "--num_batches=1"]
    assert preview.main(argv) == 0


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, cache):
    """A one-step run of the demo at test sizes, its last step saved."""
    from longt5_jax import train

    run = tmp_path_factory.mktemp("short") / "run"
    assert train.main([*TINY_RUN, "--gin.RunConfig.train_steps=1", f"--gin.MODEL_DIR='{run}'"]) == 0
    return run


@pytest.mark.slow
def test_ckpt_done_tells_a_job_script_whether_to_requeue(short_run, tmp_path, capsys):
    from longt5_jax.ckpt.__main__ import main

    assert main(["done", str(short_run)]) == 0
    assert capsys.readouterr().out.strip() == f"{short_run}: saved step 1 of 1"
    unfinished = tmp_path / "run"
    shutil.copytree(short_run, unfinished)
    shutil.rmtree(unfinished / "checkpoints")
    assert main(["done", str(unfinished)]) == 1
    assert capsys.readouterr().out.strip() == f"{unfinished}: saved step 0 of 1"
    assert main(["done", str(tmp_path)]) == 2
    assert "no config.gin" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("command", ["predict", "evaluate"])
def test_a_damaged_checkpoint_is_one_line_without_orbax_noise(short_run, cache, tmp_path, command):
    """Every array file of a short run's checkpoint overwritten: the read fails in one line."""
    run = tmp_path / "run"
    shutil.copytree(short_run, run)
    for f in run.glob("checkpoints/*/state/ocdbt.process_0/d/*"):
        f.write_bytes(bytes(range(100)))
    _prepare(tmp_path)
    argv = {
        "predict": ["--input", f"{tmp_path}/data/docs.jsonl", "--output", f"{tmp_path}/p.jsonl"],
        "evaluate": [f"--gin_file={run}/config.gin", "--gin.DataConfig.input_length=256"],
    }[command]
    before = _snapshot(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", f"longt5_jax.{command}", f"--checkpoint={run}", *argv],
        cwd=ROOT, env={**os.environ, "LONGT5_JAX_CACHE": str(cache)}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {run}/checkpoints/1: unreadable"), lines[0]
    assert proc.returncode == 2 and _snapshot(tmp_path) == before


# The start-up's environment checks (longt5_jax/environment.py), each in a process of its own
# environment: name: (the variables set, what the one line must name)
ENVIRONMENT = {
    "JAX_PLATFORMS naming an absent platform": (
        {"JAX_PLATFORMS": "cuda"},  # no GPU here
        "JAX_PLATFORMS=cuda: cuda absent here; the platforms present are cpu",
    ),
    "an unknown XLA flag": (
        {"XLA_FLAGS": "--xla_no_such_flag=1"},
        "XLA_FLAGS: XLA does not know --xla_no_such_flag=1",
    ),
}


@pytest.mark.parametrize("name", ENVIRONMENT)
def test_the_environment_is_checked_at_start_up_in_one_line(name, cache, tmp_path):
    variables, line = ENVIRONMENT[name]
    env = {**os.environ, "LONGT5_JAX_CACHE": str(cache), **variables}
    (done,) = run_forked([[sys.executable, *(a.format(d=tmp_path) for a in _train())]], env, ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {line}"), done.stderr
    assert not (tmp_path / "run").exists()


def _read_only(d: Path) -> None:
    """A directory no file can be written in, also by root (for whom permissions do not count:
    an immutable directory)."""
    d.chmod(0o555)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(d)], capture_output=True)
    try:
        (d / "probe").write_text("")
    except OSError:
        return
    (d / "probe").unlink()
    pytest.skip(f"{d} stays writable here (no chattr)")


def test_an_unusable_cache_variable_costs_the_cache_not_the_run(cache, tmp_path):
    """LONGT5_JAX_CACHE a file, JAX_COMPILATION_CACHE_DIR a read-only directory: the run
    trains without them, one warning naming each variable."""
    (tmp_path / "file").write_text("")
    locked = tmp_path / "locked"
    locked.mkdir()
    _read_only(locked)
    env = {
        **child_env(),
        "LONGT5_JAX_CACHE": str(tmp_path / "file"),
        "JAX_COMPILATION_CACHE_DIR": str(locked),
    }
    tokenizer = next(cache.glob("*.model"))  # the run's own, so that none is trained
    argv = [*TINY_RUN[:1], *TINY_RUN[2:], "--gin.RunConfig.train_steps=1"]
    argv += [f"--gin.DataConfig.tokenizer='{tokenizer}'", f"--gin.MODEL_DIR='{tmp_path}/run'"]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "longt5_jax.train", *argv],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        subprocess.run(["chattr", "-i", str(locked)], capture_output=True)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "warning" in line.lower()]
    assert len(warnings) == 2, done.stderr[-3000:]
    assert warnings[0].startswith(f"warning: LONGT5_JAX_CACHE={tmp_path / 'file'}: ")
    assert warnings[1].startswith(f"warning: JAX_COMPILATION_CACHE_DIR={locked}: ")
    assert "running without the cache" in warnings[1]
    assert (tmp_path / "run" / "checkpoints" / "1").is_dir()
    assert not list(locked.iterdir())
