"""A random LongT5 end to end: sharded-free init, a long-input forward pass, cached greedy decode.

    python -m longt5_jax.demo [--preset small] [--attention transient-global] [--input_length 4096]

Until the training entry point exists this is the main job: it shows the model runs at LongT5's
input lengths on this machine and reports how fast.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import flax.linen as nn
import jax
import numpy as np

from longt5_jax import cli
from longt5_jax.infer.decode import greedy_decode
from longt5_jax.model import LongT5, LongT5Config, count_params

T = TypeVar("T")


def _timed(label: str, fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    start = time.perf_counter()
    out: T = jax.block_until_ready(fn(*args))
    seconds = time.perf_counter() - start
    print(f"{label:<34}{seconds:9.2f} s", flush=True)
    return out, seconds


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    parser = cli.ArgumentParser(
        prog="python -m longt5_jax.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument(
        "--attention", default="transient-global", choices=["local", "transient-global"]
    )
    parser.add_argument("--input_length", type=int, default=4096)
    parser.add_argument("--decode_length", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)

    config = LongT5Config.preset(args.preset, args.attention, dtype=args.dtype)
    model = LongT5(config)
    print(
        f"LongT5 {args.preset} {config.attention}, {jax.device_count()} "
        f"{jax.devices()[0].platform} "
        f"device(s), batch {args.batch} x {args.input_length} input tokens",
        flush=True,
    )

    rng = np.random.default_rng(0)
    ids = rng.integers(2, config.vocab_size, (args.batch, args.input_length)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[:, args.input_length - args.input_length // 5 :] = 0  # a padded tail, as real batches have
    ids *= mask

    init = jax.jit(lambda key: model.init(key, ids[:, :1], None, ids[:, :1])["params"])
    params, _ = _timed("init (compile + run)", init, jax.random.key(0))
    params = nn.unbox(params)
    print(f"{'parameters':<34}{count_params(params) / 1e6:9.1f} M")

    encode = jax.jit(lambda p, x, m: model.apply({"params": p}, x, m, method=LongT5.encode))
    _timed("encode (compile + run)", encode, params, ids, mask)
    encoded, seconds = _timed("encode", encode, params, ids, mask)
    print(f"{'encoder throughput':<34}{mask.sum() / seconds:9.0f} tokens/s")
    assert np.isfinite(np.asarray(encoded)[mask > 0]).all(), "non-finite encoder output"

    _timed(
        "greedy decode (compile + run)", greedy_decode, model, params, ids, mask, args.decode_length
    )
    tokens, seconds = _timed(
        "greedy decode", greedy_decode, model, params, ids, mask, args.decode_length
    )
    print(f"{'decode throughput':<34}{tokens.size / seconds:9.0f} tokens/s")
    print("first decoded ids:", np.asarray(tokens)[0, :16].tolist())
    return 0


if __name__ == "__main__":
    sys.exit(main())
