"""transformers' PyTorch LongT5, the reference the benchmarks race: holding our parameters
(decoding), or trained from its own initialisation (a train step's time).

Needs the `test` extra (torch, transformers 4.x, which keeps LongT5's LM head untied).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from longt5_jax.formats import hf
from longt5_jax.model import LongT5Config


def available() -> bool:
    try:  # optional (the test extra): whether they are installed is the question
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def torch_longt5(config: LongT5Config, params: Any):
    """LongT5ForConditionalGeneration with exactly `params`, in eval mode."""
    import torch  # optional (the test extra), only where the reference is asked for

    model = _longt5(config)
    state = {k: torch.from_numpy(v.copy()) for k, v in hf.to_hf(config, params).items()}
    for tied in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        state[tied] = state["shared.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


def time_train_steps(
    config: LongT5Config, inputs: dict, checkpointing: bool, warmup: int, steps: int, device: str
) -> dict:
    """transformers' LongT5 of `config`'s size trained on `inputs` (`torch_inputs`) as our step
    is: float32 weights, bf16 autocast, AdamW, gradient checkpointing where our case
    rematerialises. The median step time after `warmup` steps, and the CUDA allocator's peak."""
    # torch, transformers: optional (the test extra), only where the reference is asked for
    import torch
    import transformers

    net = _longt5(config).to(device)
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


def _longt5(config: LongT5Config):
    """An untrained LongT5ForConditionalGeneration of `config`'s size."""
    import transformers  # optional (the test extra), only where the reference is asked for

    return transformers.LongT5ForConditionalGeneration(
        transformers.LongT5Config(**hf.config_to_hf(config))
    )
