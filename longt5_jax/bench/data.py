"""Input pipeline throughput against what a training step consumes, measured in the same run.

For each input length and worker count: examples/s and tokens/s out of the grain pipeline
(positions, i.e. what the step computes on, and real non-padding tokens). The reference is a
jitted forward+backward step of the model on one row of the same length on this machine; the
ratio says how many such steps the loader could feed.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from longt5_jax import cli
from longt5_jax.bench.report import write_json
from longt5_jax.data.pipeline import DataConfig, load_tokenizer, make_dataset
from longt5_jax.model import LongT5, LongT5Config
from longt5_jax.model.loss import cross_entropy


def loader_rate(cfg: DataConfig, tokenizer, batches: int) -> dict[str, float]:
    it = iter(make_dataset(cfg, tokenizer, "train", 0, 1))
    next(it)  # start-up (workers, first reads) is not throughput
    start, positions, real, rows = time.perf_counter(), 0, 0, 0
    for _ in range(batches):
        batch = next(it)
        for prefix in ("encoder", "decoder"):
            positions += batch[f"{prefix}_segment_ids"].size
            real += int((batch[f"{prefix}_segment_ids"] > 0).sum())
        rows += batch["encoder_segment_ids"].shape[0]
    seconds = time.perf_counter() - start
    return {
        "examples_per_s": rows / seconds,
        "positions_per_s": positions / seconds,
        "real_tokens_per_s": real / seconds,
    }


def step_rate(config: LongT5Config, input_length: int, target_length: int, repeats: int) -> float:
    """Positions per second of a jitted forward+backward step on one row."""
    model = LongT5(config)
    ids = jnp.ones((1, input_length), jnp.int32)
    dec = jnp.ones((1, target_length), jnp.int32)
    params = jax.jit(lambda k: model.init(k, ids[:, :1], None, dec[:, :1])["params"])(
        jax.random.key(0)
    )

    @jax.jit
    def step(p):
        def loss(p):
            logits = model.apply(p, ids, None, dec)
            return cross_entropy(logits, dec)[0].mean()

        return jax.grad(loss)({"params": p})

    jax.block_until_ready(step(params))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(params))
        times.append(time.perf_counter() - start)
    return (input_length + target_length) / float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    parser = cli.ArgumentParser(
        prog="python -m longt5_jax.bench data", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--input_lengths", type=cli.positive, nargs="+", default=[4096, 16384])
    parser.add_argument("--target_length", type=cli.positive, default=512)
    parser.add_argument("--workers", type=cli.nonnegative, nargs="+", default=[0, 2])
    parser.add_argument("--batch_size", type=cli.positive, default=8)
    parser.add_argument("--batches", type=cli.positive, default=10)
    parser.add_argument("--objective", default="summarization")
    parser.add_argument(
        "--train_files",
        nargs="+",
        default=[],
        help="files or globs to read (DataConfig.train_files); default: aclsum",
    )
    parser.add_argument("--model", default="small", help="preset of the reference step")
    parser.add_argument("--step_repeats", type=cli.positive, default=3)
    parser.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    args = parser.parse_args(argv)

    base = DataConfig(
        task="files" if args.train_files else "aclsum",
        train_files=tuple(args.train_files),
        target_length=args.target_length,
        batch_size=args.batch_size,
        objective=args.objective,
    )
    tokenizer = load_tokenizer(base)
    # Full remat, as long inputs are trained: without it a 16k step of 'small' needs ~27 GB.
    config = LongT5Config.preset(args.model, vocab_size=tokenizer.padded_vocab_size, remat="full")
    rows = []
    print(
        f"{'input':>6} {'workers':>7} {'examples/s':>11} {'positions/s':>12} "
        f"{'real tok/s':>11} {'step pos/s':>11} {'loader/step':>11}"
    )
    for length in args.input_lengths:
        step = step_rate(config, length, args.target_length, args.step_repeats)
        for workers in args.workers:
            cfg = dataclasses.replace(base, input_length=length, worker_count=workers)
            rate = loader_rate(cfg, tokenizer, args.batches)
            row = {
                "input_length": length,
                "workers": workers,
                **rate,
                "step_positions_per_s": step,
                "model": args.model,
                "ratio": rate["positions_per_s"] / step,
            }
            rows.append(row)
            print(
                f"{length:>6} {workers:>7} {rate['examples_per_s']:>11.1f} "
                f"{rate['positions_per_s']:>12.0f} {rate['real_tokens_per_s']:>11.0f} "
                f"{step:>11.0f} {row['ratio']:>10.1f}x",
                flush=True,
            )
    report = {"device": str(jax.devices()[0]), "batch_size": args.batch_size, "rows": rows}
    write_json(args.out_dir, "data", report)
    return 0
