"""`python -m longt5_jax.doctor`: the demo config passes every check on this CPU machine (as a
table, as JSON, and as two processes of `launch.local`), and each problem it looks for is a
failing row with its fix, found before any run: an absent platform, an unknown XLA flag, a port
taken, an unwritable cache, a missing data file, a MODEL_DIR that two processes do not share.
It leaves nothing behind."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from helpers import child_env

from longt5_jax.data.pipeline import DataConfig, load_tokenizer
from longt5_jax.doctor import __main__ as doctor
from longt5_jax.doctor import storage
from longt5_jax.launch.local import free_port

ROOT = Path(__file__).resolve().parents[1]
DEMO = ["--gin_file=configs/demo.gin", "--gin.RunConfig.cpu_devices=0"]  # 8 devices here
# Two processes of one fake CPU device each: the demo data-parallel over them.
TWO = [
    "--gin_file=configs/demo.gin",
    "--gin.ParallelConfig.data=-1",
    "--gin.ParallelConfig.tensor=1",
    "--gin.DataConfig.input_length=256",
    "--gin.DataConfig.target_length=32",
]


def _table(out: str) -> dict[str, tuple[str, str]]:
    """A printed table's rows: check -> (status, detail)."""
    found = re.findall(r"^(\S.*?) {2,}(ok|warn|fail) {2,}(.*)$", out, re.MULTILINE)
    return {check: (status, detail) for check, status, detail in found}


def _rows(out: str) -> dict[str, dict]:
    return {f"{r['group']}/{r['check']}": r for r in json.loads(out)["rows"]}


def test_the_demo_passes_every_check_as_a_table_and_as_json(tmp_path, capsys):
    model_dir = tmp_path / "runs" / "demo"
    assert doctor.main([*DEMO, f"--gin.MODEL_DIR='{model_dir}'"]) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0].split() == ["check", "status", "detail"]
    assert lines[-1].endswith("0 fail: nothing stops this run here"), table
    for check, status, detail in [
        ("software/jax", "ok", "(tested ==0.10.2)" if jax.__version__ == "0.10.2" else ""),
        ("devices/devices", "ok", "cpu: 8 x cpu"),
        ("config/gin", "ok", "parses and builds"),
        ("config/mesh", "ok", "data 4 x tensor 2 x pipeline 1 on 8 devices"),
        ("config/memory", "ok", "fits: step estimate"),
        ("kernels/attention", "ok", "xla: auto on cpu"),
        ("storage/MODEL_DIR", "ok", f"{model_dir} can be created and is writable"),
        ("storage/free space", "ok", "a checkpoint is"),
        ("storage/data", "ok", "aclsum"),
        ("environment/metrics port", "ok", "off"),
    ]:
        assert _table(table)[check][0] == status and detail in _table(table)[check][1], table
    # JSON, with the fused kernels checked against XLA's attention (interpreted here).
    assert doctor.main([*DEMO, f"--gin.MODEL_DIR='{model_dir}'", "--json", "--check_kernels"]) == 0
    found = json.loads(capsys.readouterr().out)
    rows = _rows(json.dumps(found))
    assert found["ok"] and {r["status"] for r in rows.values()} == {"ok"}, rows
    assert "interpreted in float32, forward and backward" in rows["kernels/layer"]["detail"]
    assert set(rows) == set(_table(table)) | {"kernels/layer"}
    assert not (tmp_path / "runs").exists()  # the doctor never creates a run


def test_each_problem_is_a_failing_row_with_its_fix(tmp_path, monkeypatch, capsys):
    tokenizer = load_tokenizer(DataConfig(tokenizer_vocab_size=2000)).path
    (tmp_path / "file").write_text("")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    monkeypatch.setenv("LONGT5_JAX_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setenv("XLA_FLAGS", f"{os.environ['XLA_FLAGS']} --xla_no_such_flag=1")
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # no GPU here
    platforms = jax.config.jax_platforms
    args = [
        *DEMO,
        f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
        f"--gin.RunConfig.prometheus_port={taken.getsockname()[1]}",
        f"--gin.DataConfig.tokenizer='{tokenizer}'",
        "--gin.DataConfig.task='files'",
        f"--gin.DataConfig.train_files=['{tmp_path / 'missing.jsonl'}']",
        "--json",
    ]
    try:
        assert doctor.main(args) == 1
    finally:
        jax.config.update("jax_platforms", platforms)
        taken.close()
    rows = _rows(capsys.readouterr().out)
    failing = {name: r for name, r in rows.items() if r["status"] == "fail"}
    assert set(failing) == {
        "environment/XLA_FLAGS",
        "environment/JAX_PLATFORMS",
        "environment/metrics port",
        "storage/LONGT5_JAX_CACHE",
        "storage/DataConfig.train_files",
    }, rows
    assert "--xla_no_such_flag=1" in failing["environment/XLA_FLAGS"]["detail"]
    assert (
        "cuda absent here; the platforms present are cpu"
        in (failing["environment/JAX_PLATFORMS"]["detail"])
    )
    assert "is taken" in failing["environment/metrics port"]["detail"]
    assert "is a file, not a directory" in failing["storage/LONGT5_JAX_CACHE"]["detail"]
    assert "missing.jsonl" in failing["storage/DataConfig.train_files"]["detail"]
    assert all(r["fix"] for r in failing.values())
    assert not (tmp_path / "run").exists()
    # Everything else still checked, on the platform present.
    assert rows["config/mesh"]["status"] == rows["storage/tokenizer"]["status"] == "ok"


def test_two_processes_of_launch_local_share_storage_and_reduce(tmp_path):
    model_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "longt5_jax.launch.local", "--command=doctor",
         "--num_processes=2", "--devices_per_process=1", "--", *TWO,
         f"--gin.MODEL_DIR='{model_dir}'"],
        env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    # Process 0 prints (the other only gloo's line on joining).
    lines = [line for line in done.stdout.splitlines() if "[Gloo]" not in line]
    table = [line.removeprefix("[0/2] ") for line in lines]
    assert not any(line.startswith("[1/2]") for line in table), done.stdout
    rows = _table("\n".join(table))
    assert rows["processes/shared storage"][0] == "ok", done.stdout
    assert str(model_dir) in rows["processes/shared storage"][1], done.stdout
    assert rows["processes/all-reduce"] == ("ok", "a sum over all 2 devices of 2 processes is 2")
    assert table[-1].endswith("0 fail: nothing stops this run here"), done.stdout
    assert not model_dir.exists()


def test_a_model_dir_two_processes_do_not_share_fails_naming_the_process(tmp_path):
    """Two processes on one machine, each given its own MODEL_DIR (as two nodes each with a
    local disk at the same path would see it)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "longt5_jax.doctor",
                *TWO,
                "--gin.RunConfig.cpu_devices=1",
                f"--gin.MODEL_DIR='{tmp_path / f'node{i}' / 'run'}'",
                f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={i}",
            ],
            env={**child_env(), "JAX_PLATFORMS": "cpu"},
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outs
    table = outs[0][0].replace("[0/2] ", "")
    status, detail = _table(table)["processes/shared storage"]
    assert status == "fail" and "MODEL_DIR is not shared storage" in detail, table
    assert detail.startswith(f"process 1 on {socket.gethostname()}: cannot read the token"), table
    assert "fix: put MODEL_DIR on storage every node mounts at the same path" in table
    assert all("[Gloo]" in line for line in outs[1][0].splitlines())  # process 0 prints
    assert not list(tmp_path.rglob("*run*"))  # process 0's token and directory removed


@pytest.mark.parametrize("variable", ["LONGT5_JAX_CACHE", "JAX_COMPILATION_CACHE_DIR"])
def test_the_cache_rows_try_to_write(tmp_path, variable, monkeypatch):
    monkeypatch.setenv(variable, str(tmp_path / "new" / "cache"))
    assert [r.status for r in storage.cache_rows() if r.check == variable] == ["ok"]
    assert not (tmp_path / "new").exists()  # probed in the nearest directory, not created


def test_unset_cache_variables_say_where_files_go(tmp_path, monkeypatch):
    """Unset, LONGT5_JAX_CACHE's default directory must be writable (a HOME that is a file is
    a failure with its fix); an unset compile cache is no failure, only said."""
    (tmp_path / "home").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for variable in storage.environment.CACHES:
        monkeypatch.delenv(variable, raising=False)
    rows = {r.check: r for r in storage.cache_rows()}
    assert rows["LONGT5_JAX_CACHE"].status == "fail", rows
    assert "is a file, not a directory" in rows["LONGT5_JAX_CACHE"].detail
    assert rows["JAX_COMPILATION_CACHE_DIR"].status == "ok"
    assert rows["JAX_COMPILATION_CACHE_DIR"].detail.startswith("unset: no cache of compiled")
