"""`launch/slurm/train.sbatch` under a real SLURM: munged, slurmctld and slurmd on this machine as
one CPU node (Debian's slurm-wlm and munge; `.ci/run` installs them). Skipped, with the reason,
where they are missing or cannot start (they need root). First, the devices a task takes from
what SLURM tells it."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_RUN, child_env

from longt5_jax.training import distributed

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
# The tiny demo (its gin file is GIN_FILE; no cpu_devices: two tasks of one CPU each make one fake
# device each, the allocation's), data-parallel over the 2 devices.
RUN = [
    *TINY_RUN[2:],
    "--gin.RunConfig.train_steps=8",
    "--gin.OptimizerConfig.total_steps=8",
    "--gin.CheckpointConfig.save_every=2",
    "--gin.ParallelConfig.data=2",
    "--gin.ParallelConfig.tensor=1",
]
JOB = ["--ntasks=2", "--ntasks-per-node=2", "--gpus-per-task=0", "--cpus-per-task=1", "--time=10"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(d: Path) -> str:
    """One node, this machine's CPUs and memory as slurmd finds them; no cgroups (none in a
    container); requeued jobs start again after 5 s instead of 120 (cred_expire)."""
    node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True)
    node = node.stdout.splitlines()[0]
    name = node.split()[0].split("=")[1]
    return f"""ClusterName=test
SlurmctldHost={name}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d / "munge.socket"},cred_expire=5
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d / "spool"}
SlurmctldPidFile={d / "slurmctld.pid"}
SlurmdPidFile={d / "slurmd.pid"}
SlurmctldLogFile={d / "slurmctld.log"}
SlurmdLogFile={d / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
MinJobAge=600
SchedulerParameters=sched_interval=1,bf_interval=1
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=cpu Nodes={name} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    def __init__(self, directory: Path):
        self.dir = directory
        self.env = {**child_env(), "SLURM_CONF": str(directory / "slurm.conf")}
        self.daemons: list[subprocess.Popen] = []

    def start(self, *command: str) -> None:
        log = (self.dir / f"{command[0]}.out").open("w")
        self.daemons.append(
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        )

    def stop(self) -> None:
        for p in self.daemons:  # nothing of theirs outlives the test: no need to wait for a save
            p.kill()
            p.wait()

    def __call__(self, *command: str, **env: str) -> str:
        out = subprocess.run(
            command, capture_output=True, text=True, env={**self.env, **env}, timeout=60
        )
        assert out.returncode == 0, f"{command}: {out.stderr}"
        return out.stdout.strip()

    def submit(self, model_dir: Path, *run: str, **env: str) -> str:
        """The job id of the sbatch script training the demo with `run`, as a user submits it
        (with the script's own settings `env`)."""
        return self(
            "sbatch",
            "--parsable",
            *JOB,
            f"--chdir={ROOT}",
            f"--output={model_dir}.out",
            str(ROOT / "launch" / "slurm" / "train.sbatch"),
            **{
                "MODEL_DIR": str(model_dir),
                "GIN_FILE": "configs/demo.gin",
                "GIN_ARGS": " ".join(run),
                "PYTHON": sys.executable,
                **env,
            },
        )

    def job(self, job_id: str) -> dict[str, str]:
        fields = self("scontrol", "show", "job", "-o", job_id).split()
        return dict(f.split("=", 1) for f in fields if "=" in f)

    def wait(self, job_id: str, log: Path, timeout: float = 300) -> dict[str, str]:
        """The job's record once it has ended for good (not pending a requeue)."""
        deadline = time.monotonic() + timeout
        while (job := self.job(job_id))["JobState"] not in ("COMPLETED", "FAILED", "CANCELLED"):
            assert time.monotonic() < deadline, (job, _tail(log))
            time.sleep(1)
        return job


def _tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else f"{path}: no output"


STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "n[1-8]",
    "SLURM_NTASKS": "32",
    "SLURM_PROCID": "14",
    "SLURM_NODEID": "3",
    "SLURM_LOCALID": "2",
    "SLURM_STEP_TASKS_PER_NODE": "4(x8)",
    "SLURM_CPUS_PER_TASK": "8",
}


def _devices(**env: str) -> tuple:
    p = distributed.detect({}, {**STEP, **env})
    return p.local_device_ids, p.cpu_devices


def test_a_task_takes_the_devices_slurm_gave_it():
    # --gpus-per-task: SLURM shows the task only its own GPUs; it takes them all.
    assert _devices(CUDA_VISIBLE_DEVICES="2", SLURM_GPUS_PER_TASK="1") == (None, 0)
    assert _devices(CUDA_VISIBLE_DEVICES="5,6", SLURM_GPUS_ON_NODE="8") == (None, 0)
    # GPUs per node, seen by every task there: each takes its share by SLURM_LOCALID.
    assert _devices(CUDA_VISIBLE_DEVICES="0,1,2,3", SLURM_GPUS_ON_NODE="4") == ((2,), 0)
    two = {"SLURM_STEP_TASKS_PER_NODE": "3,2(x2)", "SLURM_NODEID": "2", "SLURM_LOCALID": "1"}
    assert _devices(CUDA_VISIBLE_DEVICES="0,1,2,3", **two) == ((2, 3), 0)
    with pytest.raises(ValueError, match="4 tasks on a node share 2 GPUs"):
        _devices(CUDA_VISIBLE_DEVICES="0,1")
    # No GPU: one fake CPU device per CPU of the task; the config's count without --cpus-per-task.
    assert _devices()[1] == 8
    assert (
        distributed.detect({}, {k: v for k, v in STEP.items() if "CPUS" not in k}).cpu_devices == 0
    )
    assert distributed.tasks_on_node("4(x2),3", 2) == 3


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("SLURM's daemons need root")
    missing = [c for c in COMMANDS if not shutil.which(c)]
    if missing:
        pytest.skip(f"SLURM: {', '.join(missing)} not installed (apt-get install slurm-wlm munge)")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    try:
        (d / "slurm.conf").write_text(_conf(d))
    except subprocess.CalledProcessError as e:
        pytest.skip(f"SLURM: `slurmd -C` failed ({e.stderr.strip()[:200]})")
    cluster = Cluster(d)
    cluster.start(
        "munged", "-F", "--force", f"--socket={d / 'munge.socket'}", f"--key-file={key}",
        f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munge.seed'}",
        f"--log-file={d / 'munged.log'}",
    )  # fmt: skip
    cluster.start("slurmctld", "-D", "-c", "-f", str(d / "slurm.conf"))
    cluster.start("slurmd", "-D", "-c", "-f", str(d / "slurm.conf"))
    try:
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline:
            probe = subprocess.run(
                ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=cluster.env
            )
            state = probe.stdout.strip() or probe.stderr.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        else:
            logs = " | ".join(
                (_tail(d / f).splitlines() or [""])[-1] for f in ("slurmctld.log", "slurmd.log")
            )
            pytest.skip(f"SLURM's daemons did not start ({state}): {logs}")
        yield cluster
    finally:
        cluster.stop()


def _losses(model_dir: Path) -> dict[int, float]:
    """Each step's loss; a step logged again after a resume keeps its last value."""
    rows = [json.loads(r) for r in (model_dir / "metrics.jsonl").open()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("runs") / "whole"
    # With the script's Prometheus settings: its tasks serve on every interface and the job
    # lists them for Prometheus' file-based discovery (no wait for a last scrape here).
    targets, port = tmp_path_factory.mktemp("targets"), _free_port()
    # The step count comes in EXTRA_ARGS, bound after GIN_ARGS (whose tiny run says 4 steps):
    # 8 steps logged say it arrived. (The sigterm test's job gives it in GIN_ARGS.)
    steps = "--gin.RunConfig.train_steps=8"
    run = (*(a for a in RUN if a != steps), "--gin.RunConfig.prometheus_grace_seconds=0")
    settings = {
        "PROMETHEUS_PORT": str(port),
        "PROMETHEUS_TARGETS": str(targets),
        "EXTRA_ARGS": steps,
    }
    job = slurm.wait(slurm.submit(model_dir, *run, **settings), Path(f"{model_dir}.out"))
    log = Path(f"{model_dir}.out").read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, log[-3000:])
    (listed,) = json.loads((targets / f"longt5-{job['JobId']}.json").read_text())
    node = job["NodeList"]
    assert listed == {"targets": [f"{node}:{port}", f"{node}:{port + 1}"],
                      "labels": {"slurm_job": job["JobId"]}}  # fmt: skip
    assert job["Restarts"] == "0" and "requeueing" not in log
    # Two processes of one fake CPU device each (the allocation's), with no override given.
    assert "[0/2] " in log and "2 devices" in log, log[-3000:]
    # The doctor ran first, under srun in the job: every task checked, process 0 printed.
    doctor = log[: log.index("parameters, mesh")]
    assert "processes/all-reduce" in doctor and "a sum over all 2 devices" in doctor, doctor
    assert "processes/shared storage" in doctor and "nothing stops this run here" in doctor
    return _losses(model_dir)


@pytest.mark.slow
def test_a_two_task_job_runs_to_completion(uninterrupted):
    assert list(uninterrupted) == list(range(1, 9))


def _rows(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _wait_for(what, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, _tail(log)
        time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_saves_and_requeues_and_the_job_resumes_to_the_same_losses(
    slurm, uninterrupted, tmp_path
):
    """SIGTERM to the batch shell alone (what `--signal=B:TERM@N` sends), to the tasks alone
    (`scancel`'s default), then to the shell, srun and the tasks (`--full`): each time the job
    requeues and resumes; it ends with the losses of the uninterrupted run."""
    model_dir = tmp_path / "run"
    log = Path(f"{model_dir}.out")
    metrics = model_dir / "metrics.jsonl"
    # Without the doctor, which every requeued start would run again (2 tasks, 4 starts): the
    # script's doctor is the typo test's and the two-task job's; this one is about signals.
    job_id = slurm.submit(model_dir, *RUN, DOCTOR="0")
    for restarts, how in enumerate((["--batch"], [], ["--full"])):
        logged = _rows(metrics)
        _wait_for(lambda n=logged: _rows(metrics) > n, log)  # this run has logged a step
        slurm("scancel", "--signal=TERM", *how, job_id)
        _wait_for(lambda n=restarts: log.read_text().count("resumed from step") > n, log)
        out = log.read_text()
        assert out.count(f"requeueing job {job_id}") == restarts + 1, out[-3000:]
        run = out.split("requeueing job")[restarts]
        if how == ["--full"]:  # srun gets it too and kills the tasks: they resume from a save
            assert "srun: forcing job termination" in run, run[-3000:]
        else:  # every task finishes the step it is in and saves it
            assert "[0/2] SIGTERM: saved step" in run and "[1/2] SIGTERM: saved step" in run
    job = slurm.wait(job_id, log)
    out = log.read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, out[-3000:])
    assert job["Restarts"] == "3", out[-3000:]
    assert "nothing stops this run here" not in out  # DOCTOR=0: no doctor's table
    assert _losses(model_dir) == uninterrupted


@pytest.mark.slow
def test_a_gin_typo_ends_the_job_with_status_2(slurm, tmp_path):
    model_dir = tmp_path / "typo"
    job = slurm.wait(
        slurm.submit(model_dir, *RUN, "--gin.RunConfig.train_stepz=3"), tmp_path / "typo.out"
    )
    out = Path(f"{model_dir}.out").read_text()
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "2:0", (job, out[-3000:])
    assert "train_stepz" in out and "Traceback" not in out, out[-3000:]
    # The doctor found it before training: its table's row and the script's one line.
    row = next(line for line in out.splitlines() if "config/gin" in line)
    assert " fail " in row and "train_stepz" in row, out[-3000:]
    assert "error: the doctor's checks failed" in out, out[-3000:]
    assert "parameters, mesh" not in out and not model_dir.exists(), out[-3000:]


@pytest.mark.slow
def test_a_job_without_gin_file_is_refused_in_one_line(slurm, tmp_path):
    """No default run: without GIN_FILE the script would have pretrained on the demo set."""
    model_dir = tmp_path / "nothing"
    job = slurm.wait(slurm.submit(model_dir, GIN_FILE=""), Path(f"{model_dir}.out"))
    out = Path(f"{model_dir}.out").read_text()
    assert job["ExitCode"] == "2:0", (job, out)
    assert out.strip().splitlines() == [next(li for li in out.splitlines() if "GIN_FILE" in li)]
    assert out.startswith("error: GIN_FILE is not set: set GIN_FILE to the run's gin file")
