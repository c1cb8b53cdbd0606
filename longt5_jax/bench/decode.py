"""Decoding throughput: summaries/s of long documents, greedy and beam search, against
transformers' `generate` on the same weights, inputs and device, measured in the same run; or,
with `--target GPU`, the HBM bytes of the same decoding on that GPU (compiled without it)
against the least a step must move.

Both decode the same random-weight model to the same tokens (our decoding matches `generate`
token for token), so they do the same work; runs alternate so that drift hits both alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from longt5_jax import cli
from longt5_jax.bench import results as page
from longt5_jax.bench.report import write_json
from longt5_jax.estimate import decode_bytes, targets
from longt5_jax.formats import torch_reference
from longt5_jax.infer.decode import DecodeConfig, generate
from longt5_jax.model import LongT5, LongT5Config


def _parse(argv: list[str]) -> argparse.Namespace:
    p = cli.ArgumentParser(prog="python -m longt5_jax.bench decode", description=__doc__)
    p.add_argument("--preset", default="small")
    p.add_argument("--attention", default="transient-global", choices=["local", "transient-global"])
    p.add_argument("--input_length", type=cli.positive, default=4096)
    p.add_argument("--max_length", type=cli.positive, default=128, help="summary tokens decoded")
    p.add_argument(
        "--batch_size", type=cli.positive, nargs="+", help="documents a call (1; --target: 1 8)"
    )
    p.add_argument("--beams", type=cli.positive, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=cli.positive, default=3)
    p.add_argument("--no_reference", action="store_true", help="skip transformers")
    p.add_argument(
        "--target", help=f"{targets.names_help()}: HBM bytes a step on it (deviceless), not time"
    )
    p.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    page.add_argument(p)
    args = p.parse_args(argv)
    args.batch_size = args.batch_size or ([1, 8] if args.target else [1])
    page.check(args.results, "decode", argv)
    return args


def _params(config: LongT5Config, seed: int = 0):
    ids = jnp.ones((1, 1), jnp.int32)
    init = jax.jit(lambda k: nn.unbox(LongT5(config).init(k, ids, None, ids))["params"])
    return init(jax.random.key(seed))


def _ours_encoder(model, params, ids, mask):
    encode = jax.jit(lambda p, i, m: model.apply({"params": p}, i, m, method=LongT5.encode))

    def run():
        return jax.block_until_ready(encode(params, ids, mask))

    return run


def _theirs_encoder(torch_model, ids, mask):
    import torch  # the optional reference (the test extra), only when it is installed

    ids_t, mask_t = torch.from_numpy(ids).long(), torch.from_numpy(mask).long()

    def run():
        with torch.inference_mode():
            return torch_model.get_encoder()(input_ids=ids_t, attention_mask=mask_t)

    return run


def _ours(model, params, ids, mask, beams, length):
    cfg = DecodeConfig(num_beams=beams)

    def run():
        tokens, _ = generate(model, params, ids, mask, cfg, length)
        return np.asarray(jax.device_get(tokens))

    return run


def _theirs(torch_model, ids, mask, beams, length):
    import torch  # the optional reference (the test extra), only when it is installed

    ids_t, mask_t = torch.from_numpy(ids).long(), torch.from_numpy(mask).long()

    def run():
        with torch.inference_mode():
            out = torch_model.generate(
                input_ids=ids_t,
                attention_mask=mask_t,
                max_new_tokens=length,
                min_length=0,
                do_sample=False,
                num_beams=beams,
            )
        return out.numpy()[:, 1:]

    return run


def _timed(fn) -> tuple[float, np.ndarray]:
    began = time.perf_counter()
    out = fn()
    return time.perf_counter() - began, out


def _lengths(tokens: np.ndarray, eos: int) -> list[int]:
    """Each summary's tokens up to and including EOS."""
    return [int(np.flatnonzero(r == eos)[0] + 1) if (r == eos).any() else len(r) for r in tokens]


def _decoded(tokens: np.ndarray, eos: int) -> float:
    """Mean tokens per summary up to and including EOS."""
    return float(np.mean(_lengths(tokens, eos)))


def _parts_cells(parts: dict[str, float]) -> str:
    return f"{parts['encoder_s']:>6.2f} {parts['first_token_s']:>6.2f} {parts['step_ms']:>7.1f}"


def _row(batch: int, beams: int, times: list, compile_s: float, tokens, eos: int):
    """Our timings of one beam count: the report's row and the table's line."""
    mean = statistics.median(times)
    row = {
        "batch": batch,
        "beams": beams,
        "seconds": mean,
        "summaries_per_s": batch / mean,
        "decoded_tokens": _decoded(tokens, eos),
        "compile_and_first_s": compile_s,
        "times": times,
    }
    row["tokens_per_s"] = row["decoded_tokens"] * batch / mean
    line = (
        f"{batch:>5} {beams:>5} {mean:>8.2f} {row['summaries_per_s']:>7.3f} "
        f"{row['tokens_per_s']:>7.1f} {compile_s:>9.1f}"
    )
    return row, line


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.target:
        return _bytes(args, argv)
    config = LongT5Config.preset(args.preset, args.attention)
    model, params = LongT5(config), _params(config)
    reference = not args.no_reference and torch_reference.available()
    torch_model = None
    if reference:
        import torch  # the optional reference (the test extra), only when it is installed

        torch_model = torch_reference.torch_longt5(config, jax.device_get(params))
        print(f"transformers on {torch.get_num_threads()} threads; ours on {jax.devices()[0]}")
    rows = []
    # Where a summary's time goes, each side: the encoder, the first token, then each step.
    parts = f"{'enc s':>6} {'1st s':>6} {'step ms':>7}"
    print(
        f"{'batch':>5} {'beams':>5} {'ours s':>8} {'summ/s':>7} {'tok/s':>7} {'compile s':>9} "
        f"{parts} {'hf s':>8} {'hf summ/s':>9} {'speed-up':>8} {'spread':>9} {parts}"
    )
    for batch in args.batch_size:
        rng = np.random.default_rng(0)
        ids = rng.integers(2, config.vocab_size, (batch, args.input_length)).astype(np.int32)
        for beams in args.beams:
            row, line = _race(args, config, (model, params), torch_model, ids, beams)
            rows.append(row)
            print(line, flush=True)
    out = Path(args.out_dir)
    report = {
        "device": str(jax.devices()[0]),
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "rows": rows,
    }
    write_json(out, "decode", report)
    page.publish(args, "decode", argv, markdown(rows), where=page.machine())
    return 0


def _parts(runs: dict, repeats: int) -> dict[tuple[str, str], float]:
    """Median seconds of each of `runs` ((side, part) -> call), run in turn `repeats` times."""
    times: dict[tuple[str, str], list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(_timed(run)[0])
    return {name: statistics.median(t) for name, t in times.items()}


def _side(parts: dict[tuple[str, str], float], side: str) -> dict[str, float]:
    return {part: seconds for (of, part), seconds in parts.items() if of == side}


def _where_time_goes(total: float, parts: dict[str, float], steps: int) -> dict[str, float]:
    """A summary's seconds split: the encoder once, the first token (the decoder's first step,
    which also computes the cross-attention keys), then each further step."""
    return {
        "encoder_s": parts["encoder"],
        "first_token_s": parts["first"] - parts["encoder"],
        "step_ms": 1e3 * (total - parts["first"]) / max(steps - 1, 1),
    }


def _race(args, config: LongT5Config, ours_model, torch_model, ids: np.ndarray, beams: int):
    """Ours and transformers' (when given) decoding of `ids`, runs alternating, and where each
    one's time goes: a row and a line of the table."""
    batch, mask = ids.shape[0], np.ones_like(ids)
    model, params = ours_model
    ours = _ours(model, params, ids, mask, beams, args.max_length)
    compile_s, tokens = _timed(ours)
    runs = {
        ("ours", "encoder"): _ours_encoder(model, params, ids, mask),
        ("ours", "first"): _ours(model, params, ids, mask, beams, 1),
    }
    theirs = None
    if torch_model is not None:
        theirs = _theirs(torch_model, ids, mask, beams, args.max_length)
        runs |= {
            ("theirs", "encoder"): _theirs_encoder(torch_model, ids, mask),
            ("theirs", "first"): _theirs(torch_model, ids, mask, beams, 1),
        }
    for run in runs.values():  # compile, warm up
        run()
    times, ref_times = [], []
    for _ in range(args.repeats):  # alternate: drift hits both alike
        seconds, tokens = _timed(ours)
        times.append(seconds)
        if theirs is not None:
            seconds, ref_tokens = _timed(theirs)
            ref_times.append(seconds)
    parts = _parts(runs, args.repeats)
    # The loop runs until its last row (or beam search) is done: as many steps as the longest.
    steps = int(max(_lengths(tokens, config.eos_id)))
    row, line = _row(batch, beams, times, compile_s, tokens, config.eos_id)
    row["ours_parts"] = _where_time_goes(row["seconds"], _side(parts, "ours"), steps)
    line += " " + _parts_cells(row["ours_parts"])
    if ref_times:
        ratios = [r / t for r, t in zip(ref_times, times, strict=True)]
        ref = statistics.median(ref_times)
        row |= {
            "reference_seconds": ref,
            "reference_times": ref_times,
            "speedup": statistics.median(ratios),
            "speedup_range": [min(ratios), max(ratios)],
            "same_tokens": bool(_same(tokens, ref_tokens, config)),
            "reference_parts": _where_time_goes(ref, _side(parts, "theirs"), steps),
        }
        line += (
            f" {ref:>8.2f} {batch / ref:>9.3f} {row['speedup']:>7.2f}x "
            f"{min(ratios):.2f}-{max(ratios):.2f} {_parts_cells(row['reference_parts'])}"
        )
    return row, line


def _bytes(args: argparse.Namespace, argv: list[str]) -> int:
    """`--target`: the HBM bytes of decoding on that GPU against the bound, compiled without it."""
    target, _ = targets.open_target(args.target, 1, 1)
    config = LongT5Config.preset(args.preset, args.attention, dtype=target.dtype(None))
    print(
        f"{config.dtype} {args.preset} {args.attention}, {args.input_length:,} input tokens, "
        f"{args.max_length} decoded, on {target.description} (compiled deviceless)"
    )
    print(
        f"{'batch':>5} {'beams':>5} {'prefill GB':>10} {'step MB':>8} {'bound MB':>8} "
        f"{'x bound':>7} {'MB/token':>8}"
    )
    rows = []
    for batch in args.batch_size:
        for beams in args.beams:
            began = time.perf_counter()
            found = decode_bytes.measured(
                config, target, batch, beams, args.input_length, args.max_length
            )
            rows.append(_bytes_row(found, time.perf_counter() - began))
            print(
                f"{batch:>5} {beams:>5} {found.prefill / 1e9:>10.2f} {found.step / 1e6:>8.1f} "
                f"{found.bound.total / 1e6:>8.1f} {found.over_bound:>6.2f}x "
                f"{found.per_token / 1e6:>8.2f}",
                flush=True,
            )
    report = {
        "target": args.target,
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "dtype": config.dtype,
        "rows": rows,
    }
    write_json(Path(args.out_dir), "decode_bytes", report)
    where = page.machine(target=target.description)
    page.publish(args, "decode", argv, bytes_markdown(rows), where=where)
    return 0


def _bytes_row(found: decode_bytes.DecodeBytes, compile_s: float) -> dict:
    return {
        "batch": found.batch,
        "beams": found.beams,
        "prefill_bytes": found.prefill,
        "step_bytes": found.step,
        "bytes_per_token": found.per_token,
        "bound_bytes": dataclasses.asdict(found.bound) | {"total": found.bound.total},
        "over_bound": found.over_bound,
        "compile_s": compile_s,
    }


def bytes_markdown(rows: list[dict]) -> str:
    """The results page's table of `--target`: a step's bytes against its bound."""
    columns = [
        "batch", "beams", "prefill GB", "step MB", "bound MB (weights, self cache, cross)",
        "step / bound", "MB a token",
    ]  # fmt: skip
    table = [
        [
            r["batch"],
            r["beams"],
            f"{r['prefill_bytes'] / 1e9:.2f}",
            f"{r['step_bytes'] / 1e6:.1f}",
            "{:.1f} ({:.1f}, {:.1f}, {:.1f})".format(
                *(r["bound_bytes"][k] / 1e6 for k in ("total", "weights", "self_cache", "cross"))
            ),
            f"{r['over_bound']:.2f}x",
            f"{r['bytes_per_token'] / 1e6:.2f}",
        ]
        for r in rows
    ]
    return page.markdown(columns, table)


def markdown(rows: list[dict]) -> str:
    """The results page's table: ours and transformers' seconds a call by beam count, and
    where each one's time goes (encoder s, first token s, ms a further step)."""
    columns = [
        "batch", "beams", "ours s", "summaries/s", "tokens/s", "transformers s", "speed-up",
        "range", "encoder s", "first token s", "ms a step",
    ]  # fmt: skip
    table = [
        [
            r["batch"],
            r["beams"],
            f"{r['seconds']:.2f}",
            f"{r['summaries_per_s']:.3f}",
            f"{r['tokens_per_s']:.1f}",
            *_theirs_cells(r),
            *_split_cells(r, "encoder_s", "{:.2f}"),
            *_split_cells(r, "first_token_s", "{:.2f}"),
            *_split_cells(r, "step_ms", "{:.1f}"),
        ]  # fmt: skip
        for r in rows
    ]
    return page.markdown(columns, table)


def _split_cells(row: dict, part: str, form: str) -> list[str]:
    """'ours / transformers' of one part of a summary's time (ours alone without them)."""
    ours = form.format(row["ours_parts"][part])
    if "reference_parts" not in row:
        return [ours]
    return [f"{ours} / {form.format(row['reference_parts'][part])}"]


def _theirs_cells(row: dict) -> list[str]:
    if "speedup" not in row:
        return ["", "", ""]
    low, high = row["speedup_range"]
    return [f"{row['reference_seconds']:.2f}", f"{row['speedup']:.2f}x", f"{low:.2f}-{high:.2f}"]


def _same(ours: np.ndarray, theirs: np.ndarray, config: LongT5Config) -> bool:
    """Token-for-token equal up to each EOS (transformers pads after EOS with EOS)."""
    width = ours.shape[1]
    theirs = np.pad(theirs, [(0, 0), (0, width - theirs.shape[1])], constant_values=config.pad_id)
    for row in theirs:
        eos = np.flatnonzero(row == config.eos_id)
        if eos.size:
            row[eos[0] + 1 :] = config.pad_id
    return np.array_equal(ours, theirs)
