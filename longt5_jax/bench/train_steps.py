"""Timed training steps (forward, backward, AdamW update; float32) of our model and of
transformers' PyTorch LongT5 on the same weights and batch, and the device's matmul peak.

transformers' step runs in a process of its own (`TorchProcess`), as anyone would run it: the
frameworks share neither thread pools nor allocator state.

Ours is the training code path: `ShardedStep`'s jitted step (donated state, compiled ahead of time
once) on a one-device mesh with
`optim.make_optimizer` AdamW. Both sides optimise the same objective, token-mean cross-entropy
without z-loss and without weight decay, so their first losses agree to float32 rounding.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from longt5_jax.bench.pipeline import random_batch
from longt5_jax.formats import torch_reference
from longt5_jax.model import LongT5, LongT5Config
from longt5_jax.parallel.mesh import ParallelConfig, make_mesh
from longt5_jax.training.optim import OptimizerConfig, make_optimizer
from longt5_jax.training.step import ShardedStep, StepConfig

LEARNING_RATE = 1e-3
# T5X's z-loss has no counterpart in transformers; without it both differentiate the same loss.
STEP_CONFIG = StepConfig(z_loss=0.0)
OPTIMIZER_CONFIG = OptimizerConfig(
    name="adamw", learning_rate=LEARNING_RATE, schedule="constant", warmup_steps=0
)


def cores() -> int:
    """CPU cores this process may run on (what both frameworks are given)."""
    return len(os.sched_getaffinity(0))


def features(config: LongT5Config, batch_size: int, length: int, target_length: int) -> dict:
    """A random unpadded batch in our feature format (inputs and targets end in EOS)."""
    return random_batch(batch_size, length, target_length, config.vocab_size)


class OursStep:
    """Our jitted train step on one device; each call runs one step and returns its seconds."""

    def __init__(self, config: LongT5Config, batch: dict, seed: int = 0):
        mesh = make_mesh(ParallelConfig(data=1), jax.devices()[:1])
        self.step = ShardedStep(
            LongT5(config),
            STEP_CONFIG,
            make_optimizer(OPTIMIZER_CONFIG),
            mesh,
            ParallelConfig(data=1),
        )
        self.state = self.step.init(jax.random.key(seed))
        self.batch = jax.device_put(
            {k: jnp.asarray(v) for k, v in batch.items()}, self.step.batch_sharding
        )
        self.initial_params = jax.device_get(self.state.params)
        # Compiled once, ahead of time: the executable `step` would run, and its memory and cost
        # analysis without a second compilation.
        self.compiled = self.step.lower(self.state, self.batch).compile()
        self.losses: list[float] = []

    def __call__(self) -> float:
        began = time.perf_counter()
        self.state, metrics = self.compiled(self.state, self.batch, None)
        loss = float(jax.block_until_ready(metrics["loss"]))
        seconds = time.perf_counter() - began
        self.losses.append(loss)
        return seconds


def torch_inputs(batch: dict) -> dict:
    """Our features as transformers' keyword arguments (labels -100 where the weight is 0)."""
    import torch  # the optional reference (the test extra), only for the race against it

    labels = np.where(batch["decoder_loss_weights"] > 0, batch["decoder_target_tokens"], -100)
    return {
        "input_ids": torch.from_numpy(np.asarray(batch["encoder_input_tokens"])).long(),
        "attention_mask": torch.from_numpy(np.asarray(batch["encoder_segment_ids"]) > 0).long(),
        "decoder_input_ids": torch.from_numpy(np.asarray(batch["decoder_input_tokens"])).long(),
        "labels": torch.from_numpy(labels).long(),
    }


class TorchStep:
    """transformers' LongT5ForConditionalGeneration holding `params`, trained by AdamW."""

    def __init__(self, config: LongT5Config, params: Any, batch: dict, threads: int):
        import torch  # the optional reference (the test extra), only for the race against it

        torch.set_num_threads(threads)
        self.model = torch_reference.torch_longt5(config, params).train()
        # Same hyperparameters as OPTIMIZER_CONFIG; decay 0 (torch's default 0.01 would differ).
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=LEARNING_RATE,
            betas=(OPTIMIZER_CONFIG.b1, OPTIMIZER_CONFIG.b2),
            eps=OPTIMIZER_CONFIG.eps,
            weight_decay=0.0,
        )
        self.inputs = torch_inputs(batch)
        self.losses: list[float] = []

    def __call__(self) -> float:
        began = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(**self.inputs).loss
        loss.backward()
        self.optimizer.step()
        seconds = time.perf_counter() - began
        self.losses.append(float(loss.detach()))
        return seconds


def _serve_torch_steps(conn, config, params, batch, threads) -> None:
    """The child side of `TorchProcess`: one step per request, replying (seconds, loss)."""
    step = TorchStep(config, params, batch, threads)
    conn.send("ready")
    while conn.recv() == "step":
        seconds = step()
        conn.send((seconds, step.losses[-1]))
    conn.close()


class TorchProcess:
    """`TorchStep` in a spawned process, driven step by step; `close()` ends it."""

    def __init__(self, config: LongT5Config, params: Any, batch: dict, threads: int):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        arrays = jax.tree.map(np.asarray, params)
        self._process = context.Process(
            target=_serve_torch_steps,
            args=(child, config, arrays, {k: np.asarray(v) for k, v in batch.items()}, threads),
            daemon=True,
        )
        self._process.start()
        child.close()
        if self._conn.recv() != "ready":
            raise RuntimeError("the transformers step process did not start")
        self.losses: list[float] = []

    def __call__(self) -> float:
        self._conn.send("step")
        seconds, loss = self._conn.recv()
        self.losses.append(loss)
        return seconds

    def close(self) -> None:
        self._conn.send("stop")
        self._process.join(timeout=60)


def peak_matmul_flops(
    size: int = 2048, chain: int = 4, repeats: int = 5, dtype: Any = jnp.float32
) -> dict:
    """Best-of-`repeats` FLOP/s of `chain` dependent size x size matmuls in `dtype`, one jit."""
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (size, size), dtype)
    # Scaled so that the chained products stay O(1) (no overflow, no denormals).
    b = (jax.random.normal(key_b, (size, size), jnp.float32) / np.sqrt(size)).astype(dtype)

    @jax.jit
    def chained(a, b):
        for _ in range(chain):
            a = a @ b
        return a

    jax.block_until_ready(chained(a, b))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready(chained(a, b))
        times.append(time.perf_counter() - began)
    flops = chain * 2.0 * size**3
    return {
        "size": size,
        "chain": chain,
        "flops_per_s": flops / min(times),
        "median_flops_per_s": flops / float(np.median(times)),
        "times": times,
    }
