"""Runs that nothing corrupts, as a user meets them, each in fresh processes: one run per
MODEL_DIR, a data file changed under a run, outputs over inputs, a resume as another run.

Each refusal is one line on stderr naming the culprit, exit 2, no traceback, and every file that
existed before exactly as it was.
"""

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    NO_EVAL,
    child_env,
    hold_lock,
    read_until,
    run_forked,
    run_process,
    snapshot,
    start_process,
    train_command,
)

from longt5_jax import cli
from longt5_jax.model import LongT5Config
from longt5_jax.training import identity, run_lock

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env():
    """The tests' processes: the compile settings of every process the tests start, and the
    data cache as it is (the run's tokenizer is the one every training test uses)."""
    return child_env("JAX_PLATFORMS")


def _one_line(proc: subprocess.CompletedProcess, *named: str) -> str:
    """The refusal: exit 2, one line on stderr naming each of `named`, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert all(n in lines[0] for n in named), lines[0]
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    return lines[0]


def _recorded(lock: Path, proc: subprocess.Popen) -> bytes:
    """The lock file once `proc` has recorded itself in it."""
    while proc.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(lock.read_bytes())["pid"] == proc.pid:
                return lock.read_bytes()
        time.sleep(0.05)
    raise AssertionError(f"the run ended (exit {proc.returncode}): {proc.stderr.read()[-3000:]}")


def _steps(model_dir: Path) -> list[int]:
    rows = map(json.loads, (model_dir / "metrics.jsonl").read_text().splitlines())
    return [r["step"] for r in rows if "loss" in r]


@pytest.mark.slow
def test_a_second_run_on_a_busy_model_dir_is_refused_and_a_rerun_resumes(tmp_path, env):
    """Two real runs of one MODEL_DIR at once (a requeued job starting while the old one runs):
    the second is refused naming the first, which goes on unharmed; then the same command
    resumes it."""
    run = tmp_path / "run"
    long_run = ["--gin.RunConfig.train_steps=400", "--gin.CheckpointConfig.save_every=2"]
    first = start_process(train_command(run, *NO_EVAL, *long_run), env)
    try:
        lock = _recorded(run / "train.lock", first)  # held from before the first compile
        second = run_process(train_command(run, *NO_EVAL, "--gin.RunConfig.train_steps=4"), env)
        _one_line(second, f"MODEL_DIR={run} is in use by pid {first.pid} on host ", "train.lock")
        assert (run / "train.lock").read_bytes() == lock  # the refusal touched nothing
        read_until(first, "step      2/400")
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, err[-3000:]
    saved = int(re.search(r"SIGTERM: saved step (\d+);", out)[1])
    assert _steps(run) == list(range(1, saved + 1))  # one writer: every step once, in order
    assert not (run / "train.lock").exists()
    again = run_process(
        train_command(run, *NO_EVAL, f"--gin.RunConfig.train_steps={saved + 1}"), env
    )
    assert again.returncode == 0 and f"resumed from step {saved} " in again.stdout, again.stderr
    assert _steps(run) == list(range(1, saved + 2))


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(tmp_path, env):
    holder = hold_lock(tmp_path / "run")  # takes the lock as a run does, then dies holding it
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    proc = run_process(
        train_command(tmp_path / "run", *NO_EVAL, "--gin.RunConfig.train_steps=1"), env
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "train.lock" in line]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0].startswith(
        f"warning: {tmp_path}/run/train.lock: taking over from pid {holder.pid} on host "
    )
    assert warnings[0].endswith(f": pid {holder.pid} is no longer running")
    assert _steps(tmp_path / "run") == [1] and not (tmp_path / "run" / "train.lock").exists()


def test_every_process_of_a_refused_multi_process_run_says_so(tmp_path, env):
    """Process 0 takes the lock for the run; the others learn its answer and stop with it."""
    holder = hold_lock(tmp_path / "run")
    try:
        proc = run_process(
            [sys.executable, "-m", "longt5_jax.launch.local", "--num_processes=2",
             "--devices_per_process=4", "--", *train_command(tmp_path / "run")[3:]],
            {**env, "XLA_FLAGS": cli.xla_flags_for_child()},
        )  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("[launcher] ")]
    assert sorted(line[:13] for line in lines) == ["[0/2] error: ", "[1/2] error: "], proc.stderr
    assert all(f"is in use by pid {holder.pid}" in line for line in lines), proc.stderr
    assert "error" not in proc.stdout
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["train.lock"]


@pytest.mark.parametrize("rerun", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_data_file_truncated_under_a_run_stops_it_in_one_line(tmp_path, env, rerun):
    """The JSONL source was memory-mapped: a file truncated under the run killed it with SIGBUS
    (exit -7, nothing said). Now the run stops in one line naming the file, its last
    checkpoint intact, and (slow) once the file is back the same command resumes."""
    data = tmp_path / "train.jsonl"
    words = ["the", "model", "reads", "long", "documents", "and", "writes", "short", "summaries"]
    records = [
        {"article": " ".join(words[(i + j) % len(words)] for j in range(300)), "abstract": "a b c"}
        for i in range(64)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))  # 64 records, 28 pages
    original = data.read_bytes()
    files = ["--gin.DataConfig.task='files'", f"--gin.DataConfig.train_files='{data}'"]
    command = train_command(
        tmp_path / "run", *NO_EVAL, *files, "--gin.CheckpointConfig.save_every=2"
    )
    run = start_process([*command[:-1], "--gin.RunConfig.train_steps=400", command[-1]], env)
    try:
        read_until(run, "step      2/400")
        os.truncate(data, 0)
        out, err = run.communicate(timeout=300)
    finally:
        run.kill()
    proc = subprocess.CompletedProcess(run.args, run.returncode, out, err)
    _one_line(proc, f"error: {data}: changed during the run (0 bytes, {len(original):,} when")
    saved = [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()]
    assert saved and all((p / "state").is_dir() for p in saved)
    last = max(int(p.name) for p in saved)
    if not rerun:
        return
    data.write_bytes(original)
    again = run_process(
        [*command[:-1], f"--gin.RunConfig.train_steps={last + 1}", command[-1]], env
    )
    assert again.returncode == 0 and f"resumed from step {last} " in again.stdout, again.stderr


def _train(*args: str) -> list[str]:
    """Resume the trained run of the case's directory for 2 more steps."""
    return train_command("{d}/run", *NO_EVAL, "--gin.RunConfig.train_steps=4", *args)[1:]


PREDICT = ["-m", "longt5_jax.predict", "--checkpoint={d}/run", "--input={d}/docs.jsonl"]
CKPT = "{d}/run/checkpoints/2"
EVAL = ["-m", "longt5_jax.evaluate", "--checkpoint={d}/run", "--gin_file={d}/run/config.gin"]
FILES = ["--gin.DataConfig.task='files'", "--gin.DataConfig.eval_files='{d}/val_predictions.jsonl'"]
# name: (command line with {d} for the case's directory, what the one line must name)
CASES = {
    # A resume as another run.
    "resume with another tokenizer": (
        _train("--gin.DataConfig.tokenizer='{other}'"),
        "MODEL_DIR={d}/run holds a run with another tokenizer (sha256 ",
    ),
    "resume with another objective": (
        _train("--gin.DataConfig.objective='span_corruption'"),
        "DataConfig.objective='summarization' (now 'span_corruption')",
    ),
    "resume with another model": (
        _train("--gin.LongT5Config.d_ff=64", "--gin.LongT5Config.dropout_rate=0.1"),
        "LongT5Config.d_ff=128 (now 64); LongT5Config.dropout_rate=0.0 (now 0.1)",
    ),
    "resume of a run without run.json with another tokenizer": (
        _train("--gin.DataConfig.tokenizer='{other}'"),
        "another tokenizer (sha256 ",  # checked against the checkpoint's own
    ),
    # A start-up check that fails after the data, the model and the state are built: nothing
    # in MODEL_DIR is written before every check has passed (config.gin was).
    "resume with the metrics port taken": (
        _train("--gin.RunConfig.prometheus_port={port}"),
        "RunConfig.prometheus_port={port}: cannot listen on 127.0.0.1:{port}",
    ),
    "resume with an eval file that is missing": (
        _train(*FILES[:1], "--gin.DataConfig.train_files='{d}/val_predictions.jsonl'")
        + ["--gin.DataConfig.eval_files='{d}/missing.jsonl'", "--gin.EvalConfig.loss_every=2"],
        "{d}/missing.jsonl",
    ),
    # An output over an input.
    "predict --output is --input": (
        [*PREDICT, "--output={d}/docs.jsonl"],
        "--output {d}/docs.jsonl is --input {d}/docs.jsonl, which this command reads",
    ),
    "predict of a binary file": (
        [*PREDICT[:3], "--input={d}/binary.txt", "--output={d}/out.jsonl"],
        "{d}/binary.txt: not UTF-8 text (byte 0xff is not UTF-8)",
    ),
    "predict --output is a link to --input": (
        [*PREDICT, "--output={d}/link.jsonl"],
        "--output {d}/link.jsonl is --input {d}/docs.jsonl",
    ),
    "predict --output is --input by a relative path": (
        [*PREDICT, "--output={relative}"],
        "--output {relative} is --input {d}/docs.jsonl",
    ),
    "predict --output is --tokenizer": (
        [*PREDICT, "--output={d}/other.model", "--tokenizer={d}/other.model"],
        "--output {d}/other.model is --tokenizer {d}/other.model",
    ),
    "predict --output inside the checkpoint": (
        [*PREDICT, f"--output={CKPT}/predictions.jsonl"],
        f"--output {CKPT}/predictions.jsonl lies inside --checkpoint {CKPT}",
    ),
    "predict --output over a run's metrics": (
        [*PREDICT, "--output={d}/run/metrics.jsonl"],
        "would write over metrics.jsonl of the training run in MODEL_DIR={d}/run",
    ),
    "evaluate --output_dir is the checkpoint": (
        [*EVAL, f"--output_dir={CKPT}"],
        f"the output {CKPT}/val_predictions.jsonl lies inside --checkpoint {CKPT}",
    ),
    "evaluate output over its data": (
        [*EVAL, *FILES, "--output_dir={d}"],
        "the output {d}/val_predictions.jsonl is the val data file {d}/val_predictions.jsonl",
    ),
    "ckpt convert into its source": (
        ["-m", "longt5_jax.ckpt", "convert", "native-to-hf", "{d}/run", f"{CKPT}/hf"],
        f"OUT {CKPT}/hf lies inside SRC {CKPT}",
    ),
    "ckpt convert over a run's checkpoints": (
        ["-m", "longt5_jax.ckpt", "convert", "hf-to-native", "{d}/hf", "{d}/run/checkpoints/9"],
        "would write inside checkpoints of the training run in MODEL_DIR={d}/run",
    ),
    "data.convert over its input shard": (
        ["-m", "longt5_jax.data_convert", "--input={d}/shards/train-00000-of-00001.array_record"]
        + ["--output_dir={d}/shards", "--overwrite"],
        "the shard {d}/shards/train-00000-of-00001.array_record is --input",
    ),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, env):
    """A run of 2 steps, saved at its last; and a small SentencePiece model of another run."""
    from longt5_jax.data.tokenizer import train_tokenizer

    run = tmp_path_factory.mktemp("trained") / "run"
    proc = run_process(train_command(run, *NO_EVAL, "--gin.RunConfig.train_steps=2"), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "run.json").is_file() and (run / "checkpoints" / "2").is_dir()
    texts = [f"another corpus, sentence {i}: {i * 7} documents and summaries" for i in range(300)]
    return run, train_tokenizer(texts, 200, "other")


def _prepare(d: Path, name: str, run: Path, other: Path) -> None:
    """A case's directory: a copy of the trained run and the inputs every case may name."""
    from array_record.python import array_record_module

    shutil.copytree(run, d / "run")
    if "without run.json" in name:
        (d / "run" / "run.json").unlink()
    (d / "docs.jsonl").write_text('{"id": "1", "article": "one short document"}\n')
    (d / "link.jsonl").symlink_to(d / "docs.jsonl")
    (d / "binary.txt").write_bytes(b"\xff\xfe\x00 not text")
    (d / "val_predictions.jsonl").write_text('{"article": "a document", "abstract": "a b"}\n')
    shutil.copy(other, d / "other.model")
    (d / "hf").mkdir()
    (d / "shards").mkdir()
    writer = array_record_module.ArrayRecordWriter(
        str(d / "shards" / "train-00000-of-00001.array_record"), "group_size:1"
    )
    writer.write(json.dumps({"article": "a document", "abstract": "a b"}).encode())
    writer.close()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, trained, env):
    """Every case run at once (`run_forked`); each result with its directory's files before and
    after."""
    run, other = trained
    cases = {}
    taken = socket.create_server(("127.0.0.1", 0))  # the port a metrics endpoint cannot have
    for name, (argv, _) in CASES.items():
        d = tmp_path_factory.mktemp(name.replace(" ", "_").replace("-", ""))
        _prepare(d, name, run, other)
        values = {"d": d, "other": d / "other.model"}
        values["relative"] = os.path.relpath(d / "docs.jsonl", ROOT)
        values["port"] = taken.getsockname()[1]
        command = [sys.executable, *(a.format(**values) for a in argv)]
        cases[name] = (values, command, snapshot(d))
    done = run_forked([c for _, c, _ in cases.values()], env, ROOT)
    taken.close()
    return {
        name: (values, proc, before, snapshot(values["d"]))
        for (name, (values, _, before)), proc in zip(cases.items(), done, strict=True)
    }


@pytest.mark.parametrize("name", CASES)
def test_a_resume_as_another_run_or_an_output_over_an_input_is_refused(outcomes, name):
    values, proc, before, after = outcomes[name]
    _one_line(proc, CASES[name][1].format(**values))
    assert after == before


def test_a_new_run_may_start_from_another_runs_parameters_with_another_tokenizer(
    tmp_path, trained, env
):
    """Fine-tuning is a new run (its own MODEL_DIR, its own identity) from another's
    parameters: nothing of the source run is compared."""
    run, other = trained
    args = [f"--gin.CheckpointConfig.init_from='{run}'", f"--gin.DataConfig.tokenizer='{other}'"]
    proc = run_process(
        train_command(tmp_path / "new", *NO_EVAL, *args, "--gin.RunConfig.train_steps=1"), env
    )
    assert proc.returncode == 0 and f"parameters from {run}/checkpoints/2;" in proc.stdout, (
        proc.stderr
    )
    pinned = json.loads((tmp_path / "new" / "run.json").read_text())
    assert pinned["tokenizer_sha256"] == hashlib.sha256(other.read_bytes()).hexdigest()
    assert (
        pinned["tokenizer_sha256"] != json.loads((run / "run.json").read_text())["tokenizer_sha256"]
    )


def test_a_run_writes_only_the_files_no_command_may_write_over(trained):
    """cli.RUN_FILES is what the output check protects: every name a run writes at the top of
    its MODEL_DIR (and the lock, gone once it ends)."""
    run, _ = trained
    assert {p.name for p in run.iterdir()} <= set(cli.RUN_FILES) - {"train.lock"}
    assert {run_lock.LOCK_NAME, identity.IDENTITY_NAME} <= set(cli.RUN_FILES)


def test_remat_the_kernels_and_the_scan_are_free_to_change_on_a_resume_and_no_other_field_is():
    base = LongT5Config()
    pinned = identity.of(b"model", "t.model", base, "summarization")
    for free in (dict(remat="full"), dict(attention_kernel="pallas"), dict(scan_layers=False)):
        changed = dataclasses.replace(base, **free)
        assert identity.of(b"model", "t.model", changed, "summarization") == pinned
    for field in dataclasses.fields(LongT5Config):
        assert (field.name in pinned["model"]) == (field.name not in identity.FREE_FIELDS)
