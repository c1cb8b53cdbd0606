"""`python -m longt5_jax.evaluate --gin_file=... --checkpoint=CKPT [--split val] [--limit N]`

Eval loss and ROUGE-1/2/L/Lsum of a checkpoint on a split of the configured task. CKPT is a step
directory or a MODEL_DIR (its latest complete checkpoint), and the `config.gin` a run saved in
its MODEL_DIR works as the gin file. Writes `<split>_predictions.jsonl` (id, prediction,
reference) and `<split>_metrics.json` to MODEL_DIR/eval/step_<N>/ (or --output_dir).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from longt5_jax import cli, configuration
from longt5_jax.data.pipeline import DataConfig, global_batch
from longt5_jax.data.sources import expand
from longt5_jax.errors import UsageError
from longt5_jax.formats.atomic import write_atomic
from longt5_jax.formats.native import model_config, resolve, step_of
from longt5_jax.infer import evaluation
from longt5_jax.infer.decode import DecodeConfig
from longt5_jax.infer.evaluation import EvalConfig
from longt5_jax.infer.generator import from_checkpoint, load_tokenizer_for
from longt5_jax.parallel.devices import cpu_devices
from longt5_jax.parallel.mesh import ParallelConfig
from longt5_jax.training.identity import FREE_FIELDS
from longt5_jax.training.run_config import RunConfig
from longt5_jax.training.step import Evaluator


@dataclasses.dataclass(frozen=True)
class EvalSections:
    """The sections evaluation builds; the model is the checkpoint's."""

    run: RunConfig
    data: DataConfig
    parallel: ParallelConfig
    eval: EvalConfig
    decode: DecodeConfig


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = cli.ArgumentParser(prog="python -m longt5_jax.evaluate", description=__doc__)
    parser.add_argument("--checkpoint", required=True, help="a step directory or a MODEL_DIR")
    parser.add_argument("--split", default="", help="default: EvalConfig.split")
    parser.add_argument("--limit", type=int, default=0, help="only the first N examples (0: all)")
    parser.add_argument("--output_dir", default="", help="default: MODEL_DIR/eval/step_<N>")
    parser.add_argument("--tokenizer", default="", help="for a checkpoint saved without one")
    return parser.parse_known_args(argv)


def _model_dir(step_dir: Path) -> Path:
    """The MODEL_DIR a step directory belongs to (its parent if it stands alone)."""
    return step_dir.parent.parent if step_dir.parent.name == "checkpoints" else step_dir.parent


def _configure(argv: list[str], step_dir: Path) -> EvalSections:
    cfg, _ = configuration.from_args(
        argv,
        EvalSections,
        # Run configs require a MODEL_DIR: here it is the checkpoint's (unless bound again).
        preset=[f"MODEL_DIR = '{_model_dir(step_dir)}'"],
        file_required="--gin_file is required (a run's MODEL_DIR/config.gin works)",
    )
    return cfg


def _check_model(step_dir: Path) -> None:
    """The model the gin files and bindings describe, where they describe one, is the
    checkpoint's: the checkpoint's is what runs, and a contradiction would pass unseen."""
    saved = dataclasses.asdict(model_config(step_dir))
    for field, value in configuration.bound("LongT5Config").items():
        if field in saved and field not in FREE_FIELDS and value != saved[field]:
            raise UsageError(
                f"LongT5Config.{field} = {value!r} contradicts --checkpoint={step_dir}, whose "
                f"{field} is {saved[field]!r}: the checkpoint's model is what is evaluated; drop "
                "the binding or give a checkpoint of that model"
            )


def _output_dir(args: argparse.Namespace, step_dir: Path) -> Path:
    return Path(args.output_dir or _model_dir(step_dir) / "eval" / f"step_{step_of(step_dir)}")


def _check_outputs(
    args: argparse.Namespace, gin_args: list[str], cfg: EvalSections, step_dir: Path
) -> None:
    """Its two output files are none of what it reads: the checkpoint, gin files, tokenizer and
    the split's data files."""
    data, split = cfg.data, args.split or cfg.eval.split
    patterns = data.train_files if split == "train" else data.eval_files
    files = expand(list(patterns)) if data.task == "files" and patterns else []
    inputs: list[cli.Named] = [("--tokenizer", args.tokenizer or None)]
    inputs += [("DataConfig.tokenizer", data.tokenizer or None)]
    inputs += [("--gin_file", f) for f in configuration.split_gin_args(gin_args)[0]]
    inputs += [(f"the {split} data file", f) for f in files]
    out = _output_dir(args, step_dir)
    outputs = [
        ("the output", out / f"{split}_{name}") for name in ("predictions.jsonl", "metrics.json")
    ]
    cli.check_outputs(outputs, inputs, [("--checkpoint", step_dir)])


def evaluate(args: argparse.Namespace, cfg: EvalSections, step_dir: Path) -> dict[str, Any]:
    """Loss and ROUGE of the checkpoint on the split; writes predictions and metrics."""
    data, split = cfg.data, args.split or cfg.eval.split
    # Every document is evaluated: the last batch is padded, never dropped.
    data = dataclasses.replace(data, shuffle=False, num_epochs=1)
    length = cfg.decode.max_length or data.target_length
    generator, _ = from_checkpoint(step_dir, cfg.parallel, cfg.decode, length)
    tokenizer = load_tokenizer_for(step_dir, args.tokenizer)
    examples = evaluation.load_examples(data, tokenizer, split, args.limit)
    truncated = sum(len(e.inputs) == data.input_length for e in examples)
    if truncated:
        print(
            f"warning: {truncated} of {len(examples)} inputs reach DataConfig.input_length="
            f"{data.input_length} and are truncated to it",
            file=sys.stderr,
        )
    began = time.perf_counter()
    evaluator = Evaluator(generator.model, generator.mesh, generator.parallel)
    loss = evaluation.eval_loss(
        lambda local: evaluator(generator.params, global_batch(local, generator.rows)),
        examples,
        data,
        data.batch_size,
    )
    metrics: dict[str, Any] = {f"eval_{k}": v for k, v in loss.items()}
    model = generator.model.config
    plan = evaluation.decoding_plan(examples, data, data.batch_size, model)
    print(plan.summary())
    with tqdm(total=len(examples), desc=f"decoding {split}", unit="doc", disable=None) as bar:
        tokens = evaluation.predict(generator.tokens, examples, plan, bar.update)
    scores, records = evaluation.rouge_of(tokenizer, examples, tokens)
    step = step_of(step_dir)
    metrics |= scores | {
        "step": step,
        "split": split,
        "examples": len(examples),
        "truncated_inputs": truncated,
        # The share of the encoder's input positions decoding padded, and what batches cut in
        # file order and padded to DataConfig.input_length would have (`infer.batches`).
        "input_padding": plan.padding,
        "input_padding_file_order": plan.file_order_padding,
        "decode": dataclasses.asdict(cfg.decode) | {"max_length": length},
        "seconds": time.perf_counter() - began,
    }
    if jax.process_index() == 0:
        out = _output_dir(args, step_dir)
        write_atomic(
            out / f"{split}_predictions.jsonl", "".join(json.dumps(r) + "\n" for r in records)
        )
        write_atomic(out / f"{split}_metrics.json", json.dumps(metrics, indent=2) + "\n")
        metrics["output_dir"] = str(out)
    return metrics


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args, rest = _parse(argv)
    if args.limit < 0:
        raise UsageError(f"--limit={args.limit}: expected >= 0 (0: every example)")
    if args.output_dir and Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        raise UsageError(f"--output_dir={args.output_dir}: a file, expected a directory")
    step_dir = resolve(args.checkpoint)
    cfg = _configure(rest, step_dir)
    _check_model(step_dir)
    _check_outputs(args, rest, cfg, step_dir)
    cpu_devices(cfg.run.cpu_devices)
    metrics = evaluate(args, cfg, step_dir)
    shown = "  ".join(f"{k} {metrics[k]:.2f}" for k in ("rouge1", "rouge2", "rougeL", "rougeLsum"))
    print(
        f"step {metrics['step']} {metrics['split']}: {metrics['examples']} examples  "
        f"loss {metrics['eval_loss']:.4f}  {shown}  -> {metrics.get('output_dir', '')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
