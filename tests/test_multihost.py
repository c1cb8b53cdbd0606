"""Multi-process training on this machine: real processes over 127.0.0.1 against one process.

(That processes read disjoint rows covering an epoch is
`test_data_pipeline.py::test_rows_read_every_example_of_an_epoch_once`; runs handed between
process counts are `test_elastic.py`.)
"""

import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import LAUNCHED_RUN, TINY_RUN, child_env, launch_local, losses_of

from longt5_jax import cli, train
from longt5_jax.launch import local
from longt5_jax.training import distributed

FIVE = ["--gin.RunConfig.train_steps=5", "--gin.CheckpointConfig.save_every=3"]
DP_TP = ["--gin_file=configs/parallel/dp4_tp2.gin"]  # (2 x 4 devices: data 2 x 2 processes)
DP_TP_PP = ["--gin_file=configs/parallel/dp2_tp2_pp2.gin"]


def test_processes_come_from_flags_or_slurm_or_neither():
    flags, rest = distributed.split_flags(
        ["--gin_file=x", "--coordinator_address", "h:1", "--num_processes=2", "--process_id=1"]
    )
    assert rest == ["--gin_file=x"]
    assert distributed.detect(flags, {}) == distributed.Processes("h:1", 2, 1)
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "gpu[07-09,12]",
        "SLURM_NTASKS": "32",
        "SLURM_PROCID": "13",
        "SLURM_LOCALID": "1",
    }
    assert distributed.detect({}, slurm) == distributed.Processes(
        "gpu07:61579", 32, 13, (1,), "slurm"
    )
    assert distributed.detect({}, {**slurm, "SLURM_NTASKS": "1"}) is None
    assert distributed.detect({}, {}) is None
    assert distributed.first_host("a1,b2") == "a1" and distributed.first_host("n[3]") == "n3"


def test_started_processes_keep_the_xla_flags_but_count_their_own_devices(monkeypatch):
    dump = "--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text"
    monkeypatch.setenv("XLA_FLAGS", f"{dump} --xla_force_host_platform_device_count=8 -x=1")
    assert cli.xla_flags_for_child() == f"{dump} -x=1"
    assert cli.xla_flags_for_child(4) == f"{dump} -x=1 --xla_force_host_platform_device_count=4"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num_processes=2", "--process_id=0"], "--coordinator_address missing"),
        (["--coordinator_address=h:1", "--num_processes=2", "--process_id=2"], "process_id=2"),
        (["--coordinator_address=h", "--num_processes=2", "--process_id=0"], "expected HOST:PORT"),
        (["--coordinator_address=h:1", "--num_processes=two", "--process_id=0"], "integers"),
    ],
)
def test_bad_distributed_flags_are_one_line_errors(argv, message, capsys):
    assert train.main([*TINY_RUN, "--gin.MODEL_DIR='/tmp/never'", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_the_launcher_reports_a_failure_and_its_status(capfd):
    """Each process's one line reaches stderr with its prefix, and nothing else is said."""
    code = local.launch(2, 2, ["--gin_file=configs/missing.gin"])
    out, err = capfd.readouterr()
    assert code == 2 and not out.strip()
    assert sorted(err.strip().splitlines()) == [
        f"[{i}/2] error: configs/missing.gin: gin file not found" for i in range(2)
    ]


def _launch(model_dir, *extra, processes=2):
    return launch_local(processes, *FIVE, *extra, f"--gin.MODEL_DIR='{model_dir}'")


def _latest_removed(model_dir, copy):
    """A copy of a finished run whose latest checkpoint (5) is gone: it resumes from 3."""
    shutil.copytree(model_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "5")
    return copy


@pytest.mark.slow
def test_two_processes_train_and_hand_checkpoints_over_like_one(tmp_path):
    """Two processes on the pipelined mesh log one process's losses, and checkpoints pass
    between them and one process on another mesh both ways. (Two processes on the plain data x
    tensor mesh, handed to one and back, are every chain of `test_elastic.py`.)"""
    one = tmp_path / "one"
    assert train.main([*TINY_RUN, *FIVE, *DP_TP, f"--gin.MODEL_DIR='{one}'"]) == 0
    want = losses_of(one)
    assert len(want) == 5
    out = _launch(tmp_path / "two", *DP_TP_PP)
    assert "[0/2] " in out and "[1/2] " in out and "8 devices" in out
    np.testing.assert_allclose(losses_of(tmp_path / "two"), want, rtol=1e-5)
    # Saved by two processes pipelined, resumed by one without the pipeline ...
    two_to_one = _latest_removed(tmp_path / "two", tmp_path / "two_to_one")
    assert train.main([*TINY_RUN, *FIVE, *DP_TP, f"--gin.MODEL_DIR='{two_to_one}'"]) == 0
    np.testing.assert_allclose(losses_of(two_to_one), want, rtol=1e-5)
    # ... and saved by one, resumed by two on the pipelined mesh.
    one_to_two = _latest_removed(one, tmp_path / "one_to_two")
    out = _launch(one_to_two, *DP_TP_PP)
    assert "resumed from step 3" in out
    np.testing.assert_allclose(losses_of(one_to_two), want, rtol=1e-5)


@pytest.mark.slow
def test_a_dead_process_stops_the_other_within_a_minute(tmp_path):
    port = local.free_port()
    env = child_env()
    env.update(JAX_PLATFORMS="cpu")
    logs = [tmp_path / f"{i}.log" for i in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "longt5_jax.train",
                *LAUNCHED_RUN,
                "--gin.RunConfig.train_steps=1000",
                "--gin.RunConfig.cpu_devices=4",
                f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
                f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={i}",
            ],
            stdout=logs[i].open("w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 300
    while "step      3/1000" not in logs[0].read_text():
        assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    code = procs[0].wait(timeout=120)
    waited = time.monotonic() - killed
    assert code != 0 and waited < 60, (code, waited, logs[0].read_text()[-2000:])
