"""Checkpoint tools, parameters-only restore, conversions and bad checkpoints.

One short training run (module fixture) makes the checkpoints most tests read.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import transformers
from helpers import (
    SCHEDULE_STEPS,
    TINY_RUN,
    Position,
    child_env,
    logits,
    padded_batch,
    train_command,
)

from longt5_jax import train
from longt5_jax.ckpt import commands
from longt5_jax.ckpt.__main__ import main as ckpt
from longt5_jax.ckpt.commands import Arrays
from longt5_jax.ckpt.convert import native_params, write_native
from longt5_jax.formats import t5x
from longt5_jax.formats.native import is_complete, model_config, resolve, step_dirs, step_of
from longt5_jax.training.identity import FREE_FIELDS


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """MODEL_DIR of a 3-step run saving every step (demo.gin keeps the last two: 2 and 3)."""
    model_dir = tmp_path_factory.mktemp("run")
    args = [*TINY_RUN, "--gin.RunConfig.train_steps=3", "--gin.CheckpointConfig.save_every=1"]
    assert train.main([*args, f"--gin.MODEL_DIR='{model_dir}'"]) == 0
    return model_dir


def _computed(config) -> dict:
    """What a model computes: its fields but those that only say how (the run's identity; other
    formats have no attention_kernel, remat or scan_layers)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in FREE_FIELDS}


def _json(capsys, *argv):
    rc = ckpt([*map(str, argv), "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out) if out.out.strip() else None, out.err.strip()


def _error(capsys, *argv) -> str:
    """The one-line error of a command that must fail with exit status 2."""
    rc = ckpt(list(map(str, argv)))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def _restore_all(step_dir: Path) -> dict:
    """An independent reader: orbax's own restore of the whole state into numpy arrays."""
    tree = ocp.StandardCheckpointer().metadata(step_dir / "state").item_metadata.tree
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = ocp.PyTreeCheckpointer().restore(
        step_dir / "state", args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args)
    )
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): np.asarray(x)
        for p, x in leaves
    }


def test_ls_lists_steps_sizes_and_completeness(run, capsys):
    (run / "checkpoints" / "4.orbax-checkpoint-tmp").mkdir()  # what a killed save leaves
    try:
        rc, rows, _ = _json(capsys, "ls", run)
        assert rc == 0
        assert [(r["step"], r["state"]) for r in rows] == [
            (2, "complete"),
            (3, "complete"),
            (4, "incomplete"),
        ]
        assert all(r["bytes"] > 0 for r in rows[:2]) and rows[0]["path"].endswith("checkpoints/2")
        assert resolve(run) == run / "checkpoints" / "3"  # the latest *complete* one
        assert ckpt(["ls", str(run)]) == 0 and " incomplete " in capsys.readouterr().out
    finally:
        (run / "checkpoints" / "4.orbax-checkpoint-tmp").rmdir()


def test_tree_reads_metadata_only_on_any_device_count(run, tmp_path, capsys):
    rc, rows, _ = _json(capsys, "tree", run)
    arrays = _restore_all(run / "checkpoints" / "3")
    assert rc == 0 and {r["path"] for r in rows} == arrays.keys()
    for r in rows:
        assert tuple(r["shape"]) == arrays[r["path"]].shape
        assert r["dtype"] == str(arrays[r["path"]].dtype)
    by_path = {r["path"]: r for r in rows}
    kernel = by_path["params/encoder/layers/attention/query/kernel"]
    assert kernel["sharding"] == "(None, 'data', 'tensor', None) over data4 x tensor2 x pipeline1"
    # Without the array data (metadata only), on one device instead of the eight it was saved on.
    copy = tmp_path / "copy"
    shutil.copytree(run / "checkpoints" / "3", copy)
    for f in (copy / "state").glob("ocdbt.process_*/d/*"):  # the arrays' chunks
        f.unlink()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-m", "longt5_jax.ckpt", "tree", str(copy), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == rows
    rc, report, _ = _json(capsys, "verify", copy)  # ... while reading the arrays fails
    assert rc == 1 and not report["ok"] and "unreadable" in report["problems"][0]


def test_arrays_are_read_in_batches_of_bounded_size(run, monkeypatch):
    """Restored a few at a time (one restore an array cost 18 ms each), never more than
    BATCH_BYTES together unless one array is larger alone: the same arrays either way."""
    step3 = run / "checkpoints" / "3"
    want = _restore_all(step3)
    arrays = Arrays(step3)
    assert len(list(arrays.batches())) == 1  # the tiny run: one restore
    monkeypatch.setattr(commands, "BATCH_BYTES", 4096)
    runs = list(arrays.batches())
    assert [n for run_ in runs for n in run_] == arrays.names and len(runs) > 3
    for run_ in runs:
        sizes = [want[n].nbytes for n in run_]
        assert len(run_) == 1 or sum(sizes) <= 4096
    got = dict(arrays)
    assert got.keys() == want.keys()
    for name, x in want.items():
        np.testing.assert_array_equal(got[name], x)


def test_stats_config_and_verify(run, capsys):
    step3 = run / "checkpoints" / "3"
    arrays = _restore_all(step3)
    rc, rows, _ = _json(capsys, "stats", run)
    assert rc == 0 and len(rows) == len(arrays)
    for r in rows:
        x = arrays[r["path"]].astype(np.float64)
        np.testing.assert_allclose(
            [r["norm"], r["min"], r["max"]], [np.linalg.norm(x), x.min(), x.max()], rtol=1e-12
        )
        assert r["nan"] == r["inf"] == 0
    rc, saved, _ = _json(capsys, "config", run)
    assert rc == 0 and "LongT5Config.d_model = 64" in saved["gin"]
    assert saved["model"]["d_model"] == 64 and model_config(step3).vocab_size == 2176
    assert ckpt(["config", str(run)]) == 0
    assert capsys.readouterr().out.strip() == saved["gin"].strip()
    rc, report, _ = _json(capsys, "verify", run)
    assert rc == 0 and report["ok"] and report["arrays"] == len(arrays)


def test_diff_reports_per_tensor_differences_and_missing_paths(run, tmp_path, capsys):
    a, b = _restore_all(run / "checkpoints" / "2"), _restore_all(run / "checkpoints" / "3")
    rc, d, _ = _json(capsys, "diff", run / "checkpoints" / "2", run)
    assert rc == 0 and not d["identical"] and not d["only_in_a"] and not d["only_in_b"]
    assert {t["path"] for t in d["tensors"]} == a.keys()
    for t in d["tensors"]:
        x, y = a[t["path"]].astype(np.float64), b[t["path"]].astype(np.float64)
        assert t["max_abs"] == np.max(np.abs(x - y), initial=0.0)
    rc, same, _ = _json(capsys, "diff", run, run / "checkpoints" / "3")
    assert rc == 0 and same["identical"] and all(t["max_abs"] == 0 for t in same["tensors"])
    params = native_params(run / "checkpoints" / "3")
    del params["encoder"]["side_relpos_bias"]
    params["decoder"]["extra"] = {"scale": np.ones(3, np.float32)}
    cfg = model_config(run / "checkpoints" / "3")
    write_native(tmp_path / "other", cfg, params, source="test")
    rc, d, _ = _json(capsys, "diff", run, tmp_path / "other")
    assert "params/encoder/side_relpos_bias/rel_embedding" in d["only_in_a"]
    assert d["only_in_b"] == ["params/decoder/extra/scale"] and not d["identical"]
    assert {t["path"] for t in d["tensors"]} == {k for k in a if k.startswith("params/")} - {
        "params/encoder/side_relpos_bias/rel_embedding"
    } | {"step"}


def test_not_a_checkpoint_incomplete_and_corrupt_give_one_line_errors(run, tmp_path, capsys):
    assert "no such file or directory" in _error(capsys, "tree", tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "empty: not a checkpoint (expected a step directory" in _error(
        capsys, "stats", tmp_path / "empty"
    )
    assert "ls: not a checkpoint" not in _error(capsys, "ls", tmp_path / "empty")
    partial = tmp_path / "7.orbax-checkpoint-tmp"
    shutil.copytree(run / "checkpoints" / "3", partial)
    assert "an incomplete checkpoint" in _error(capsys, "verify", partial)
    # Truncated array files: verify names the array; metadata-only commands still work.
    broken = tmp_path / "broken" / "checkpoints" / "3"
    shutil.copytree(run / "checkpoints" / "3", broken)
    for f in (broken / "state").glob("ocdbt.process_*/d/*"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    rc, report, _ = _json(capsys, "verify", broken.parent.parent)
    assert rc == 1 and "unreadable: truncated or corrupt" in report["problems"][0]
    assert ckpt(["verify", str(broken)]) == 1 and "PROBLEMS" in capsys.readouterr().out
    # As a user runs it: the arrays read together fail in one line, not a traceback for each
    # read orbax abandons.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-m", "longt5_jax.ckpt", "stats", str(broken)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
    assert "unreadable: truncated or corrupt" in out.stderr
    (broken / "state" / "_METADATA").unlink()
    assert "metadata" in _error(capsys, "tree", broken)


def _truncate_largest_array_file(step_dir: Path) -> None:
    """What a full disk or a dying node leaves: the biggest array file cut short."""
    biggest = max((step_dir / "state").glob("ocdbt.process_*/d/*"), key=lambda f: f.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])


def _files(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_before_it(
    run, tmp_path, capsys
):
    model_dir = tmp_path / "run"
    shutil.copytree(run, model_dir)
    damaged = model_dir / "checkpoints" / "3"
    _truncate_largest_array_file(damaged)
    before = _files(damaged)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = [*TINY_RUN, "--gin.RunConfig.cpu_devices=8", "--gin.RunConfig.train_steps=4"]
    out = subprocess.run(
        [sys.executable, "-m", "longt5_jax.train", *args, f"--gin.MODEL_DIR='{model_dir}'"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # One line on stderr (which step, why), not orbax's tracebacks; the run goes on from 2.
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    (warning,) = lines
    assert warning.startswith(f"warning: checkpoint {damaged}: unreadable: truncated or corrupt (")
    assert warning.endswith("; resuming from step 2") and "resumed from step 2" in out.stdout
    # The damaged files are kept, byte for byte, set aside where no save or clean-up goes.
    assert _files(model_dir / "checkpoints" / "3.unreadable") == before
    rows = [json.loads(line) for line in (model_dir / "metrics.jsonl").open()]
    first = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").open())}
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["loss"] == first[3]  # step 3 again, bitwise
    rc, listed, _ = _json(capsys, "ls", model_dir)
    states = {Path(r["path"]).name: r["state"] for r in listed}
    assert rc == 0 and states == {"2": "complete", "3.unreadable": "unreadable", "4": "complete"}


def test_no_readable_checkpoint_stops_in_one_line_and_keeps_everything(run, tmp_path, capsys):
    model_dir = tmp_path / "run"
    shutil.copytree(run, model_dir)
    for step in ("2", "3"):
        _truncate_largest_array_file(model_dir / "checkpoints" / step)
    before = _files(model_dir)
    capsys.readouterr()
    rc = train.main([*TINY_RUN, "--gin.RunConfig.train_steps=5", f"--gin.MODEL_DIR='{model_dir}'"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: no readable checkpoint: {model_dir / 'checkpoints' / '3'}: ")
    assert f"| {model_dir / 'checkpoints' / '2'}: unreadable" in err
    assert _files(model_dir) == before


@pytest.mark.slow
def test_fine_tuning_starts_from_the_parameters_only(run, tmp_path, capsys):
    """init_from: the parameters come from the checkpoint, the optimizer and step start anew."""
    new = tmp_path / "finetune"
    args = [*TINY_RUN, "--gin.RunConfig.train_steps=1", f"--gin.MODEL_DIR='{new}'"]
    # The warm-up's first learning rate is 0: the saved step-1 parameters are the source's.
    assert train.main([*args, f"--gin.CheckpointConfig.init_from='{run}'"]) == 0
    out = capsys.readouterr().out
    assert f"parameters from {run / 'checkpoints' / '3'}; optimizer and step start anew" in out
    rc, d, _ = _json(capsys, "diff", new, run)
    params = [t for t in d["tensors"] if t["path"].startswith("params/")]
    assert len(params) == len(jax.tree.leaves(native_params(new / "checkpoints" / "1")))
    assert all(t["max_abs"] == 0 for t in params)
    step = next(t for t in d["tensors"] if t["path"] == "step")
    assert step["max_abs"] == 2  # 1 here, 3 there
    count = next(t for t in d["tensors"] if t["path"].endswith("/count"))
    assert count["max_abs"] == 2  # AdamW's count restarted


def test_another_model_is_refused_naming_every_differing_path(run, tmp_path, capsys):
    new = tmp_path / "other"
    args = [*TINY_RUN, f"--gin.MODEL_DIR='{new}'", f"--gin.CheckpointConfig.init_from='{run}'"]
    rc = train.main([*args, "--gin.LongT5Config.attention='local'", "--gin.LongT5Config.d_ff=64"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert (
        "checkpoints/3: a checkpoint of another model or optimizer; only in the checkpoint: " in err
    )
    assert (
        "only in the checkpoint: params/encoder/layers/attention/global_input_layer_norm/scale, "
        "params/encoder/side_relpos_bias/rel_embedding;" in err
    )
    for stack in ("decoder", "encoder"):
        assert f"params/{stack}/layers/mlp/wi_0/kernel (2, 64, 128) vs (2, 64, 64)" in err
        assert f"params/{stack}/layers/mlp/wo/kernel (2, 128, 64) vs (2, 64, 64)" in err
    assert not (new / "config.gin").exists() and not (new / "metrics.jsonl").exists()
    # The reverse: a local checkpoint into a TGlobal run names what the run has and it lacks.
    params = native_params(run / "checkpoints" / "3")
    del params["encoder"]["side_relpos_bias"]
    write_native(tmp_path / "local", model_config(run / "checkpoints" / "3"), params, "test")
    args[-1] = f"--gin.CheckpointConfig.init_from='{tmp_path / 'local'}'"
    assert train.main(args) == 2
    assert "only in this run: params/encoder/side_relpos_bias/rel_embedding" in (
        capsys.readouterr().err
    )


def test_native_to_hf_gives_transformers_our_logits_and_back(run, tmp_path, capsys):
    step3 = run / "checkpoints" / "3"
    config, params = model_config(step3), native_params(step3)
    rc, report, _ = _json(capsys, "convert", "native-to-hf", run, tmp_path / "hf")
    assert rc == 0 and report["output"] == str(tmp_path / "hf")
    model = transformers.LongT5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    batch = padded_batch(config, [200, 131], [20, 9], 256, 24, seed=3)
    with torch.no_grad():
        theirs = model(
            input_ids=torch.tensor(batch.input_ids).long(),
            attention_mask=torch.tensor(batch.attention_mask),
            decoder_input_ids=torch.tensor(batch.decoder_input_ids).long(),
        ).logits.numpy()
    ours = logits(config, params, batch)
    valid = batch.decoder_attention_mask.astype(bool)
    np.testing.assert_allclose(
        theirs[valid], ours[valid], rtol=1e-5, atol=1e-5 * np.abs(ours).max()
    )
    # ... and transformers' directory back to a native checkpoint: the same parameters.
    rc, _, _ = _json(capsys, "convert", "hf-to-native", tmp_path / "hf", tmp_path / "back")
    rc, d, _ = _json(capsys, "diff", run, tmp_path / "back")
    params_diff = [t for t in d["tensors"] if t["path"].startswith("params/")]
    assert rc == 0 and len(params_diff) == len(jax.tree.leaves(params))
    assert all(t["max_abs"] == 0 for t in params_diff)
    assert _computed(model_config(resolve(tmp_path / "back"))) == _computed(config)


def test_t5x_to_native_gives_our_logits(run, tmp_path, capsys):
    step3 = run / "checkpoints" / "3"
    config, params = model_config(step3), native_params(step3)
    t5x.save(config, params, tmp_path / "checkpoint_1000")
    overrides = [f"--set=local_radius={config.local_radius}", "--set=global_block_size=16"]
    argv = ["convert", "t5x-to-native", tmp_path / "checkpoint_1000", tmp_path / "native"]
    rc, _, _ = _json(capsys, *argv, *overrides)
    assert rc == 0
    converted = resolve(tmp_path / "native")
    assert _computed(model_config(converted)) == _computed(config)
    batch = padded_batch(config, [250, 64], [12, 24], 256, 24, seed=4)
    valid = batch.decoder_attention_mask.astype(bool)
    ours, theirs = logits(config, params, batch), logits(config, native_params(converted), batch)
    np.testing.assert_allclose(theirs[valid], ours[valid], rtol=1e-6, atol=1e-6)


def test_conversions_never_overwrite_and_reject_bad_sources(run, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    for direction, src in (
        ("native-to-hf", run),
        ("hf-to-native", tmp_path),
        ("t5x-to-native", tmp_path),
    ):
        assert "taken: already exists; choose a new output path" in _error(
            capsys, "convert", direction, src, taken
        )
        assert (taken / "keep.txt").read_text() == "mine" and len(list(taken.iterdir())) == 1
    assert "config.json: missing" in _error(
        capsys, "convert", "hf-to-native", tmp_path, tmp_path / "out1"
    )
    assert "not a T5X checkpoint" in _error(
        capsys, "convert", "t5x-to-native", tmp_path, tmp_path / "out2"
    )
    assert "not a checkpoint" in _error(
        capsys, "convert", "native-to-hf", tmp_path, tmp_path / "out3"
    )
    assert not any((tmp_path / f"out{i}").exists() for i in (1, 2, 3))
    assert "--set applies to t5x-to-native" in _error(
        capsys, "convert", "hf-to-native", tmp_path, tmp_path / "o", "--set", "local_radius=3"
    )


_KILLED_SAVE = """
import os, signal, sys
import jax.numpy as jnp, numpy as np
from helpers import Position
from longt5_jax.training.checkpoint import CheckpointConfig, Checkpoints
saves = Checkpoints(sys.argv[1], CheckpointConfig(save_every=1))
w = jnp.asarray(np.random.default_rng(0).standard_normal((16, 1024, 1024), np.float32))
saves.save(1, {"w": w}, Position(1), {"gin": "", "model": {}})
saves.manager.wait_until_finished()
saves.save(2, {"w": w + 1}, Position(2), {"gin": "", "model": {}})  # returns while it writes
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sigkill_during_an_async_save_keeps_the_previous_checkpoint(tmp_path, capsys):
    from longt5_jax.training.checkpoint import CheckpointConfig, Checkpoints

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    out = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], env=env, timeout=300)
    assert out.returncode == -9
    rc, rows, _ = _json(capsys, "ls", tmp_path)
    assert [(r["step"], r["complete"]) for r in rows] == [(1, True), (2, False)]
    assert resolve(tmp_path) == tmp_path / "checkpoints" / "1"
    saves = Checkpoints(tmp_path, CheckpointConfig(save_every=1))
    assert saves.latest_step() == 1
    data = Position()
    target = {"w": jax.ShapeDtypeStruct((16, 1024, 1024), np.float32)}
    w = saves.restore(1, target, data)["w"]
    expected = np.random.default_rng(0).standard_normal((16, 1024, 1024), np.float32)
    assert np.array_equal(np.asarray(w), expected) and data.at == 1
    saves.close()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["1"]  # cleaned up


def _train_cmd(model_dir, *extra):
    return train_command(model_dir, "--gin.CheckpointConfig.save_every=3", *extra)


def _logged(lines: list, step: int) -> bool:
    return any(line.startswith(f"step {step:6d}/") for line in lines)


def _rows(model_dir):
    return [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]


def _kill_once(cmd, env, model_dir, during_save: bool, after_step: int, delay: float) -> str:
    """Run `cmd` and SIGKILL it: as soon as an asynchronous save is under way, or `delay`
    seconds after it logs `after_step` but no later than its last step's line, before that
    step's save (a kill after the run's last save would leave nothing for the next kills).
    Returns what it was killed during (or that it ended)."""
    import threading
    import time

    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    logged = []
    reader = threading.Thread(target=lambda: logged.extend(proc.stdout), daemon=True)
    reader.start()
    saves = model_dir / "checkpoints"
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if during_save:
            tmp = [p.name for p in saves.glob("*orbax-checkpoint-tmp*")] if saves.exists() else []
            if tmp:
                proc.kill()
                proc.wait()
                return f"save {tmp[0]}"
            time.sleep(0.002)
        elif _logged(logged, after_step):
            since = time.monotonic()
            while time.monotonic() - since < delay and not _logged(logged, SCHEDULE_STEPS):
                time.sleep(0.002)
            proc.kill()
            proc.wait()
            return f"{time.monotonic() - since:.2f}s after step {after_step}"
        else:
            time.sleep(0.01)
    if proc.poll() is None:
        proc.kill()
    return f"ended ({proc.wait()}): {''.join(logged)[-500:]}"


@pytest.mark.slow
def test_five_kills_anywhere_then_rerun_log_the_uninterrupted_losses_bitwise(tmp_path):
    """SIGKILL at 5 random moments, two of them during an asynchronous save: the metrics.jsonl
    of the run rerun after each kill equals the uninterrupted run's, every step bitwise."""
    import random

    seed = random.randrange(10**6)
    rng = random.Random(seed)
    env = child_env("JAX_PLATFORMS")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    extra = [f"--gin.RunConfig.train_steps={SCHEDULE_STEPS}"]
    done = subprocess.run(_train_cmd(whole, *extra), capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    kills = []
    for i in range(5):
        during_save = i in (1, 3)
        saved = [step_of(d) for d in step_dirs(killed) if is_complete(d)] if killed.exists() else []
        last = max(saved, default=0)
        assert last < SCHEDULE_STEPS, (seed, kills)  # the run has steps left to kill
        at = rng.randint(last + 1, SCHEDULE_STEPS - 1)  # a step the rerun will log
        kills.append(
            _kill_once(_train_cmd(killed, *extra), env, killed, during_save, at, rng.random())
        )
    again = subprocess.run(_train_cmd(killed, *extra), capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert not [k for k in kills if k.startswith("ended")], (seed, kills)
    assert sum(k.startswith("save ") for k in kills) == 2, (seed, kills)
    want = [(r["step"], r["loss"], r["grad_norm"]) for r in _rows(whole)]
    got = [(r["step"], r["loss"], r["grad_norm"]) for r in _rows(killed)]
    assert got == want, (seed, kills)


def test_a_checkpoint_removed_while_it_is_read_is_not_called_damaged(run, tmp_path, monkeypatch):
    """A reader (evaluate, predict, ckpt) of a live run's newest checkpoint, which the run
    removes as it saves newer ones (keep): the read fails for real, and the one line says the
    step went away, not that the checkpoint is corrupt."""
    from longt5_jax.formats import native

    model_dir = tmp_path / "run"
    shutil.copytree(run, model_dir)
    step_dir = resolve(model_dir)
    original = ocp.PyTreeCheckpointer.restore

    def removed_under_the_reader(self, *args, **kwargs):
        shutil.rmtree(step_dir)  # what the run's clean-up does between our reads
        return original(self, *args, **kwargs)

    saved = native.saved_tree(step_dir)["params"]
    params = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), saved)
    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", removed_under_the_reader)
    with pytest.raises(native.CheckpointError) as raised:
        native.restore_params(step_dir, params)
    assert not isinstance(raised.value, native.DamagedCheckpoint)
    assert str(raised.value) == (
        f"{step_dir}: removed while it was read (a running job keeps only its newest "
        "checkpoints); rerun to read the newest"
    )
