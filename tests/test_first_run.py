"""A first run as the README leads a new user through it, on one short run: TensorBoard from a
fresh environment built by the README's set-up reads back its train and eval runs over HTTP,
promtool passes the metrics endpoint at every scrape (an eval with ROUGE among them), and the
transformers export is transformers' own size and summarises as `predict` does."""

from __future__ import annotations

import contextlib
import json
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
from pathlib import Path

import pytest
import safetensors
import torch
import transformers
from helpers import child_env, free_ports, http_get, promtool_lint

from longt5_jax.data.aclsum import aclsum_source
from longt5_jax.data.tokenizer import UNK_ID, Tokenizer

ROOT = Path(__file__).resolve().parents[1]
STEPS, SUMMARY_TOKENS = 4, 16
RUN = [
    "--gin_file=configs/demo.gin",
    f"--gin.RunConfig.train_steps={STEPS}",
    "--gin.RunConfig.log_every=2",
    "--gin.DataConfig.input_length=256",
    "--gin.DataConfig.target_length=32",
    f"--gin.OptimizerConfig.total_steps={STEPS}",
    "--gin.OptimizerConfig.warmup_steps=1",
    "--gin.EvalConfig.loss_every=2",
    "--gin.EvalConfig.loss_examples=4",
    f"--gin.EvalConfig.rouge_every={STEPS}",
    "--gin.EvalConfig.rouge_examples=2",
    f"--gin.DecodeConfig.max_length={SUMMARY_TOKENS}",
    "--gin.RunConfig.prometheus_grace_seconds=2",
]

pytestmark = pytest.mark.slow


def _readme_environment(venv: Path) -> subprocess.Popen:
    """The README's set-up (python3 -m venv, pip install -e .) into `venv`, started: pip's
    cache, and --no-compile as .ci/run (nothing here runs most of what it would compile). Then
    the newest setuptools, which has no pkg_resources: what a Python 3.12 venv gets, where 3.11's
    own setuptools 65 would hide an import of it."""
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = f"{shlex.quote(str(venv / 'bin' / 'python'))} -m pip install -q --no-compile"
    script = f"{pip} -e {shlex.quote(str(ROOT))} && {pip} --upgrade setuptools"
    return subprocess.Popen(
        ["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


class _Scraper(threading.Thread):
    """Every distinct text of the endpoint while the run serves it."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.texts, self.done = url, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            with contextlib.suppress(OSError):
                text = http_get(self.url)
                if not self.texts or text != self.texts[-1]:
                    self.texts.append(text)
            time.sleep(0.2)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """(MODEL_DIR of the short run, the endpoint's texts, the README's environment)."""
    root = tmp_path_factory.mktemp("first_run")
    installing = _readme_environment(root / "venv")
    port = free_ports(1)
    scraper = _Scraper(f"http://127.0.0.1:{port}/metrics")
    scraper.start()
    model_dir = root / "run"
    argv = [*RUN, f"--gin.RunConfig.prometheus_port={port}", f"--gin.MODEL_DIR='{model_dir}'"]
    try:
        trained = subprocess.run(
            [sys.executable, "-m", "longt5_jax.train", *argv],
            capture_output=True,
            text=True,
            env=child_env(),
            cwd=ROOT,
            timeout=400,
        )
    finally:
        scraper.done.set()
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    log, _ = installing.communicate(timeout=400)
    assert installing.returncode == 0, log[-3000:]
    return model_dir, scraper.texts, root / "venv"


def _scalars(port: int, run: str, tag: str) -> dict[int, float]:
    query = f"run={urllib.parse.quote(run)}&tag={tag}"
    events = json.loads(http_get(f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?{query}"))
    return {step: value for _, step, value in events}


def test_tensorboard_from_the_readme_setup_serves_the_train_and_eval_runs(first_run, tmp_path):
    model_dir, _, venv = first_run
    gone = subprocess.run([venv / "bin" / "python", "-c", "import pkg_resources"])
    assert gone.returncode != 0, "setuptools still provides pkg_resources: the check proves less"
    port = free_ports(1)
    argv = [venv / "bin" / "tensorboard", "--logdir", model_dir / "tensorboard"]
    log = (tmp_path / "tensorboard.log").open("w")
    server = subprocess.Popen(
        [*argv, "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline, runs = time.monotonic() + 90, []
        while {"train", "training_eval/val"} - set(runs):
            assert server.poll() is None, (tmp_path / "tensorboard.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "tensorboard.log").read_text()[-3000:]
            time.sleep(0.5)
            with contextlib.suppress(urllib.error.URLError, OSError):
                runs = json.loads(http_get(f"http://127.0.0.1:{port}/data/runs"))
        rows = [json.loads(line) for line in (model_dir / "metrics.jsonl").open()]
        train = {r["step"]: r["loss"] for r in rows if "loss" in r}
        evals = {r["step"]: r for r in rows if "eval/loss" in r}
        assert sorted(train) == [2, 4] and sorted(evals) == [2, 4]
        assert _scalars(port, "train", "loss") == pytest.approx(train, rel=1e-6)
        eval_loss = {s: r["eval/loss"] for s, r in evals.items()}
        assert _scalars(port, "training_eval/val", "loss") == pytest.approx(eval_loss, rel=1e-6)
        rouge = _scalars(port, "training_eval/val", "rougeLsum")
        assert rouge == pytest.approx({STEPS: evals[STEPS]["eval/rougeLsum"]}, rel=1e-6)
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_promtool_passes_the_endpoint_at_every_scrape_of_the_run(first_run):
    _, texts, _ = first_run
    assert texts, "the endpoint was never scraped"
    with_rouge = [t for t in texts if "\nlongt5_eval_rouge_lsum " in t]
    assert with_rouge, "no scrape after the eval with ROUGE"
    assert "\nlongt5_eval_rouge_l " in with_rouge[-1]
    for text in texts:
        assert promtool_lint(text) == ""


@pytest.fixture(scope="module")
def exported(first_run, tmp_path_factory):
    model_dir = first_run[0]
    out = tmp_path_factory.mktemp("export") / "hf"
    argv = [sys.executable, "-m", "longt5_jax.ckpt", "convert", "native-to-hf", model_dir, out]
    converted = subprocess.run(argv, capture_output=True, text=True, env=child_env(), cwd=ROOT)
    assert converted.returncode == 0, converted.stderr[-3000:]
    return out


def test_the_export_is_the_size_transformers_writes_and_carries_the_runs_settings(
    exported, tmp_path
):
    generation = json.loads((exported / "generation_config.json").read_text())
    assert generation["max_length"] == SUMMARY_TOKENS + 1 and generation["num_beams"] == 1
    assert not generation["do_sample"]
    tokenizer = json.loads((exported / "tokenizer_config.json").read_text())
    assert tokenizer["model_max_length"] == 256  # the run's input length
    # transformers' own save of the same model: built from our config, filled with our tensors.
    model = transformers.LongT5ForConditionalGeneration(
        transformers.LongT5Config.from_pretrained(exported)
    )
    with safetensors.safe_open(exported / "model.safetensors", "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    model.load_state_dict(state, strict=False)
    model.save_pretrained(tmp_path / "theirs")
    ours = (exported / "model.safetensors").stat().st_size
    theirs = (tmp_path / "theirs" / "model.safetensors").stat().st_size
    assert ours == pytest.approx(theirs, rel=0.05), (ours, theirs)
    assert sum(x.numel() for x in state.values()) == model.num_parameters()  # each tensor once


def test_the_pipeline_on_the_export_summarises_as_predict_does(first_run, exported, tmp_path):
    source = aclsum_source("val")
    documents = [source[i]["inputs"] for i in range(3)]  # longer than the 256-token input
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"article": d}) + "\n" for d in documents))
    argv = ["--checkpoint", first_run[0], "--input", docs, "--output", tmp_path / "out.jsonl"]
    predicted = subprocess.run(
        [sys.executable, "-m", "longt5_jax.predict", *argv, "--max_length", str(SUMMARY_TOKENS)],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
    )
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    ours = [json.loads(x)["prediction"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    # Greedy, as the run decoded: the pipeline's own 4 beams win over generation_config.json's 1
    # (transformers keeps a pipeline default where the model's value is its global default);
    # the summary length is the export's max_length.
    summarise = transformers.pipeline(
        "summarization", model=str(exported), truncation=True, num_beams=1
    )
    with torch.no_grad():
        generated = [r["summary_token_ids"] for r in summarise(documents, return_tensors=True)]
    # The same tokens: our tokenizer writes them as predict does. The pipeline's own text drops
    # the unk and sentinel ids a 4-step model still emits (skip_special_tokens), so it equals
    # predict's where there are none.
    ours_tokenizer = Tokenizer(exported / "spiece.model")
    assert [ours_tokenizer.decode(ids) for ids in generated] == ours
    special = {UNK_ID, *range(ours_tokenizer.piece_count, ours_tokenizer.vocab_size)}
    plain = [i for i, ids in enumerate(generated) if not special & set(ids.tolist())]
    assert plain, "every summary holds a special id: no text to compare"
    theirs = [summarise.tokenizer.decode(generated[i], skip_special_tokens=True) for i in plain]
    assert theirs == [ours[i] for i in plain]
