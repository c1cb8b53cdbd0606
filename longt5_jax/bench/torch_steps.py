"""transformers' LongT5 trained as our step is, from its own initialisation: the train step
time the benchmarks race (`bench device`).

Needs the `test` extra (torch, transformers 4.x).
"""

from __future__ import annotations

import statistics
import time

from longt5_jax.formats import torch_reference
from longt5_jax.model import LongT5Config


def time_train_steps(
    config: LongT5Config, inputs: dict, checkpointing: bool, warmup: int, steps: int, device: str
) -> dict:
    """transformers' LongT5 of `config`'s size trained on `inputs` (`torch_inputs`) as our step
    is: float32 weights, bf16 autocast, AdamW, gradient checkpointing where our case
    rematerialises. The median step time after `warmup` steps, and the CUDA allocator's peak."""
    # torch, transformers: optional (the test extra), only where the reference is asked for
    import torch
    import transformers

    net = torch_reference.untrained_longt5(config).to(device)
    net.config.use_cache = False  # training: no decoder cache
    if checkpointing:
        net.gradient_checkpointing_enable()
    net.train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=device == "cuda")
    inputs = {k: v.to(device) for k, v in inputs.items()}
    times = []
    for i in range(warmup + steps):
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = net(**inputs).loss
        loss.backward()
        optimizer.step()
        float(loss.detach())  # waits for the step
        if i >= warmup:
            times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return {
        "version": transformers.__version__,
        "step_s": statistics.median(times),
        "allocator_peak": int(peak),
    }
