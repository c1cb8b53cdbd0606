"""What the tests share: tiny models and batches, transformers' LongT5 holding the same weights,
compiled programs read back, runs in processes of their own, and local servers.

Tests import these from here (`from helpers import TINY_RUN, child_env`), never from each other
(tests/test_tests.py holds that), so each test file reads on its own.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longt5_jax import cli
from longt5_jax.data import batching
from longt5_jax.estimate import hlo
from longt5_jax.formats.torch_reference import torch_longt5
from longt5_jax.model import LongT5, LongT5Config, abstract_params
from longt5_jax.training.optim import OptimizerConfig
from longt5_jax.training.step import StepConfig

ROOT = Path(__file__).resolve().parents[1]

# --- Tiny models, their batches, and transformers' LongT5 holding the same weights ---


def random_params(config: LongT5Config, seed: int = 0, noise: float = 0.1):
    """Initialised params with every leaf perturbed, so norm scales and relpos tables matter."""
    params = _initialised(config, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    # Op by op: jitted, XLA fuses the sum into one multiply-add, and the params move by an ulp.
    return jax.tree.unflatten(
        treedef,
        [x + noise * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)],
    )


# Jitted, one program per config for every seed (op by op, a call took 4-6 s): the same values.
@functools.partial(jax.jit, static_argnums=0)
def _initialised(config: LongT5Config, key: jax.Array):
    ids = jnp.ones((1, 1), jnp.int32)
    return nn.unbox(LongT5(config).init(key, ids, None, ids))["params"]


@flax.struct.dataclass
class Batch:
    """A padded batch as transformers' LongT5 takes it, ours reading the same arrays."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    decoder_input_ids: np.ndarray
    decoder_attention_mask: np.ndarray
    labels: np.ndarray


def padded_batch(
    config: LongT5Config, input_lens, target_lens, length: int, target_length: int, seed: int = 0
) -> Batch:
    """Right-padded random tokens; decoder inputs are the labels shifted right after start id 0."""
    rng = np.random.default_rng(seed)
    b = len(input_lens)
    mask = (np.arange(length)[None] < np.array(input_lens)[:, None]).astype(np.int32)
    ids = rng.integers(2, config.vocab_size, (b, length)).astype(np.int32) * mask
    dmask = (np.arange(target_length)[None] < np.array(target_lens)[:, None]).astype(np.int32)
    labels = rng.integers(2, config.vocab_size, (b, target_length)).astype(np.int32) * dmask
    dec = np.concatenate([np.zeros((b, 1), np.int32), labels[:, :-1]], axis=1) * dmask
    return Batch(ids, mask, dec, dmask, labels)


def logits(config: LongT5Config, params, batch: Batch) -> np.ndarray:
    """Our model's logits of `batch` (jitted), as numpy."""
    model = LongT5(config)
    return np.asarray(
        jax.jit(model.apply)(
            {"params": params}, batch.input_ids, batch.attention_mask, batch.decoder_input_ids
        )
    )


def torch_model(config: LongT5Config, params):
    """transformers' LongT5ForConditionalGeneration holding exactly `params`, in eval mode."""
    return torch_longt5(config, params)


def max_rel(ours, ref, where=None) -> tuple[float, float]:
    """(max |ours - ref|, that over max |ref|), optionally only where `where` is true."""
    diff, ref = np.abs(np.asarray(ours) - np.asarray(ref)), np.abs(np.asarray(ref))
    if where is not None:
        diff, ref = diff[where], ref[where]
    return float(diff.max()), float(diff.max() / max(ref.max(), 1e-30))


def tiny_batches(n=3, rows=8, length=24, target_length=8, seed=0):
    """`n` training batches of random token rows, padded as the data pipeline pads them."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        examples = [
            batching.padded_example(
                {
                    "inputs": batching.trim_with_eos(
                        rng.integers(2, 200, rng.integers(5, length)), length
                    ),
                    "targets": batching.trim_with_eos(
                        rng.integers(2, 200, rng.integers(2, target_length)), target_length
                    ),
                },
                length,
                target_length,
            )
            for _ in range(rows)
        ]
        out.append(
            batching.to_features({k: np.stack([e[k] for e in examples]) for k in examples[0]})
        )
    return out


# Adafactor factoring the tiny model's matrices (their smaller side is 8 or more).
ADAFACTOR = OptimizerConfig(
    name="adafactor",
    learning_rate=0.01,
    schedule="constant",
    warmup_steps=0,
    adafactor_min_dim_size_to_factor=8,
)


def assert_same_training(got, want):
    """(losses, params) of a sharded run equal to a single-device run's, to float32 rounding."""
    # Measured over every mesh x ZeRO stage, sequence sharding, accumulation and the dropout
    # layouts: losses within 2.4e-7 relative (2 float32 ulps), parameters after 3 SGD steps
    # within 5.6e-7 of each leaf's largest (dp2_tp4, 4 microbatches).
    losses, params = got
    np.testing.assert_allclose(losses, want[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want[1]), strict=True):
        assert np.abs(a - b).max() <= 2e-6 * np.abs(b).max()


class Position:
    """A data stream's position and nothing else: what a checkpoint saves of it."""

    def __init__(self, at=0):
        self.at = at

    def state(self):
        return {"batch_size": 1, "next": [self.at]}

    def restore(self, state):
        (self.at,) = state["next"]


# --- Compiled programs and what they are held to ---

# Largest error of the output and of every gradient over the largest value of the XLA path's,
# float32 (tests/test_long_attention_kernel.py's cases): measured worst 1.1e-6 over the encoder
# cases (tglobal_w32_g40 split; 6.4e-7 whole), 1.1e-6 over the decoder's (self_packed).
# tglobal_w64 runs with KEYS only (7.5e-7): whole, its local table's gradient (more terms a
# bucket than at W = 32) is within 1.9e-6 (2.0e-6 looped) at the tests' XLA optimisation level
# 0, 1.1e-6 at the default level (where the looped and the unrolled local keys give the same
# bits).
TOLERANCE = 2e-6


def while_bodies(hlo_text: str) -> list[str]:
    """The text of every computation used as a while loop's body in an HLO module."""
    names = set(re.findall(r"body=%?([\w.\-]+)", hlo_text))
    blocks = re.split(r"\n(?=%?[\w.\-]+ [^\n]*\{\n)", hlo_text)
    return [b for b in blocks if b.split(" ", 1)[0].lstrip("%") in names]


def zero_expected(step, stage: int, cpu: bool) -> dict:
    """The analytic ZeRO volumes of a data-parallel step over its mesh's devices: from its
    float32 gradient bytes and the bytes of the weights with an `embed` axis (those ZeRO splits)."""
    params = step.abstract_state.params
    grad = sum(4 * int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    boxed = abstract_params(step.model)
    specs = jax.tree.leaves(
        nn.get_partition_spec(boxed), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    split = sum(
        4 * int(np.prod(x.shape))
        for x, s in zip(jax.tree.leaves(params), specs, strict=True)
        if "embed" in tuple(s)
    )
    return hlo.zero_volumes(stage, grad, split, step.mesh.devices.size, cpu=cpu)


# The step tests/gpu_compile_configs.py compiles every parallel config's for the GPU cluster.
CLUSTER_SHAPE = (256, 64, 16)  # global batch (every pipeline plan and 2 microbatches divide it)
CLUSTER_STEP = StepConfig(microbatches=2, grad_dtype="bfloat16")

# How the planner and `bench cluster` refuse bfloat16 on a V100, and a small plan for both.
NO_BF16 = (
    "--dtype bfloat16: Tesla V100-SXM2-32GB (compute capability 7.0) has no bfloat16; "
    "use --dtype float16"
)
SMALL_PLAN = ["--model", "tiny", "--nodes", "1", "--gpus_per_node", "8", "--input_length", "128"]
SMALL_PLAN += ["--target_length", "16", "--batch_sizes", "16", "--show", "3"]

# --- Runs in processes of their own ---

TINY_RUN = [
    "--gin_file=configs/demo.gin",
    "--gin.RunConfig.cpu_devices=0",  # the test process already has its 8 fake devices
    "--gin.RunConfig.train_steps=4",
    "--gin.RunConfig.log_every=1",
    "--gin.DataConfig.input_length=256",
    "--gin.DataConfig.target_length=32",
    "--gin.DataConfig.tokenizer_vocab_size=2000",
    "--gin.LongT5Config.vocab_size=2176",
    "--gin.OptimizerConfig.total_steps=4",
    "--gin.OptimizerConfig.warmup_steps=1",
]
# The tiny run without cpu_devices: demo.gin's 8 fake devices, or those a launcher gives it.
LAUNCHED_RUN = [*TINY_RUN[:1], *TINY_RUN[2:]]
SCHEDULE_STEPS = 14  # the learning-rate schedule of every run `train_command` starts
NO_EVAL = ["--gin.EvalConfig.loss_every=0", "--gin.EvalConfig.rouge_every=0"]


def child_env(*drop: str) -> dict[str, str]:
    """The environment of a process a test starts, less the variables in `drop`: the tests'
    compile flags (conftest's XLA_FLAGS) less their device count, which is the process's own,
    and jax's switch for XLA's cheapest optimisation level besides. Such processes run a few
    tiny steps after compiling the step, often afresh (in a multi-process run jax writes the
    persistent cache only from process 0, and keys it by each process's devices, so the others
    always compile): compiled in a third of the time, even if their steps then run slower. They
    all compile alike, so they share the persistent cache."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["XLA_FLAGS"] = cli.xla_flags_for_child()
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    return env


def train_command(model_dir, *extra: str) -> list[str]:
    """The tiny run in a process of its own, on demo.gin's 8 fake devices. One schedule
    for every test that starts one, so that they all run one program, compiled once."""
    return [
        sys.executable,
        "-m",
        "longt5_jax.train",
        *LAUNCHED_RUN,
        f"--gin.OptimizerConfig.total_steps={SCHEDULE_STEPS}",
        *extra,
        f"--gin.MODEL_DIR='{model_dir}'",
    ]


def run_process(args: list[str], env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    """`args` run to the end in the repository, its output captured as text."""
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def start_process(args: list[str], env: dict) -> subprocess.Popen:
    """`args` started in the repository, its output piped as text."""
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def read_until(proc: subprocess.Popen, prefix: str) -> None:
    """Read the run's output until a line starts with `prefix` (that step is logged)."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return
    raise AssertionError(f"the run ended (exit {proc.wait()}): {proc.stderr.read()[-3000:]}")


def snapshot(d: Path) -> dict[str, str]:
    """Every path under `d`: 'dir', or its file's SHA-256."""
    return {
        str(p.relative_to(d)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
    }


def run_forked(commands: list[list[str]], env: dict, cwd: Path, timeout: int = 300) -> list:
    """Each command (`[sys.executable, "-m", module, *args]`) forked by tests/forkrun.py from one
    process that imported their modules once; their `subprocess.CompletedProcess`es in order."""
    for c in commands:
        assert c[:2] == [sys.executable, "-m"], c
    with tempfile.TemporaryDirectory() as d:
        plan = [
            {"argv": c[2:], "out": f"{d}/{i}.out", "err": f"{d}/{i}.err"}
            for i, c in enumerate(commands)
        ]
        Path(d, "plan.json").write_text(json.dumps(plan))
        done = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("forkrun.py")), f"{d}/plan.json"],
            env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        codes = json.loads(done.stdout.strip().splitlines()[-1])
        return [
            subprocess.CompletedProcess(
                c, rc, Path(p["out"]).read_text(), Path(p["err"]).read_text()
            )
            for c, p, rc in zip(commands, plan, codes, strict=True)
        ]


def launch_local(processes: int, *args) -> str:
    """`launch.local` of the tiny run on `processes` processes sharing 8 devices; its output."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "longt5_jax.launch.local",
            f"--num_processes={processes}",
            f"--devices_per_process={8 // processes}",
            "--",
            *LAUNCHED_RUN,
            *args,
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    return out.stdout


def losses_of(model_dir: Path) -> list[float]:
    """The losses a run logged, in order."""
    return [json.loads(line)["loss"] for line in (model_dir / "metrics.jsonl").open()]


_HOLD = (
    "import sys, time; from longt5_jax.training.run_lock import RunLock; "
    "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)"
)


def hold_lock(model_dir: Path) -> subprocess.Popen:
    """A real process that takes the lock and keeps it until it is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(model_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "held\n"
    return proc


# --- Local servers ---


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports on 127.0.0.1."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        with contextlib.ExitStack() as stack:
            try:
                for port in range(first, first + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first


def http_get(url: str) -> str:
    """The body of a GET of `url`, as text."""
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def promtool_lint(text: str) -> str:
    """What `promtool check metrics` says of an endpoint's text ('' when it passes)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    said = lint.stdout + lint.stderr
    return said or ("" if lint.returncode == 0 else f"exit {lint.returncode}")
