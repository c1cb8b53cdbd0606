"""Evaluation during training: eval loss and ROUGE of the training parameters on the training
mesh, when due. The loop is given one (`due(step)`, `__call__(step, params)`); the command builds
it, reading the eval examples at start-up so that a bad eval file stops the run before it writes.
"""

from __future__ import annotations

from typing import Any

from longt5_jax.data.pipeline import DataConfig, global_batch
from longt5_jax.data.tokenizer import Tokenizer
from longt5_jax.infer.decode import DecodeConfig
from longt5_jax.infer.evaluation import (
    EvalConfig,
    Example,
    decoding_plan,
    eval_loss,
    load_examples,
    predict,
    rouge_of,
)
from longt5_jax.infer.generator import Generator
from longt5_jax.model import LongT5
from longt5_jax.training.step import ShardedStep


class PeriodicEval:
    """Eval loss and ROUGE of the training parameters, on the training mesh, when due."""

    def __init__(
        self,
        cfg: EvalConfig,
        data: DataConfig,
        decode: DecodeConfig,
        tokenizer: Tokenizer,
        step: ShardedStep,
    ):
        self.cfg, self.data, self.decode = cfg, data, decode
        self.tokenizer, self.step = tokenizer, step
        self._examples: list[Example] | None = None

    def open(self, train_steps: int) -> PeriodicEval:
        """Read the eval examples now, if an eval falls within `train_steps`: a missing or bad
        eval file is a start-up error, not one at the first eval."""
        if any(n and n <= train_steps for n in (self.cfg.loss_every, self.cfg.rouge_every)):
            self._load(0)
        return self

    def due(self, step: int) -> bool:
        return any(n and step % n == 0 for n in (self.cfg.loss_every, self.cfg.rouge_every))

    def _load(self, limit: int) -> list[Example]:
        """The split's first `limit` examples (0: all), read once for the whole run."""
        if self._examples is None:
            c = self.cfg
            whole = c.loss_every and not c.loss_examples
            most = 0 if whole else max(c.loss_examples, c.rouge_examples)
            self._examples = load_examples(self.data, self.tokenizer, c.split, most)
        return self._examples[: limit or None]

    def __call__(self, step: int, params: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        rows = self.data.batch_size
        if self.cfg.loss_every and step % self.cfg.loss_every == 0:
            examples = self._load(self.cfg.loss_examples)
            evaluate = self.step.evaluate
            sharding = self.step.batch_sharding
            stats = eval_loss(
                lambda b: evaluate(params, global_batch(b, sharding)), examples, self.data, rows
            )
            out |= {f"eval/{k}": v for k, v in stats.items()}
        if self.cfg.rouge_every and step % self.cfg.rouge_every == 0:
            examples = self._load(self.cfg.rouge_examples)
            length = self.decode.max_length or self.data.target_length
            model = self.step.model.config
            generator = Generator(
                LongT5(model),
                params,
                self.step.mesh,
                self.step.parallel,
                self.decode,
                length,
            )
            plan = decoding_plan(examples, self.data, rows, model)
            tokens = predict(generator.tokens, examples, plan)
            scores, _ = rouge_of(self.tokenizer, examples, tokens)
            out |= {f"eval/{k}": v for k, v in scores.items() if not k.endswith(("_low", "_high"))}
        return out
