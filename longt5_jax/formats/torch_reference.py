"""transformers' PyTorch LongT5 of our model's configuration: holding our parameters, the
numerical reference the tests compare with and the benchmarks race.

Needs the `test` extra (torch, transformers 4.x, which keeps LongT5's LM head untied).
"""

from __future__ import annotations

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

    model = untrained_longt5(config)
    state = {k: torch.from_numpy(v.copy()) for k, v in hf.to_hf(config, params).items()}
    for tied in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        state[tied] = state["shared.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


def untrained_longt5(config: LongT5Config):
    """An untrained LongT5ForConditionalGeneration of `config`'s size."""
    import transformers  # optional (the test extra), only where the reference is asked for

    return transformers.LongT5ForConditionalGeneration(
        transformers.LongT5Config(**hf.config_to_hf(config))
    )
