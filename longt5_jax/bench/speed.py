"""Training speed: our step against transformers', MFU, and step time from 1k to 16k inputs.

1. vs transformers: the full train step (forward, backward, AdamW; float32, batch 1) of ours and
   of transformers' PyTorch LongT5 (in a process of its own) on the same weights, batch, CPU and
   thread count, alternating runs; the ratio is taken per pair (their step / ours) and reported
   as median and range.
2. MFU: analytic model FLOPs (`estimate.flops`) per second of our step over the peak float32
   matmul FLOP/s measured in the same run (chained 2048^2 matmuls, best of several).
3. Length scaling: our step at each input length, alternating with the reference length (4k) so
   each ratio T(L) / T(4k) is taken under the same load; next to it, what full self-attention in
   the encoder would cost at the reference run's measured FLOP/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
from pathlib import Path

import jax

from longt5_jax import cli
from longt5_jax.bench import train_steps as ts
from longt5_jax.bench.report import pyplot, save_figure, write_json
from longt5_jax.estimate import flops, hlo
from longt5_jax.formats import torch_reference
from longt5_jax.model import LongT5Config
from longt5_jax.model.config import REMAT_POLICIES


def _parse(argv: list[str]) -> argparse.Namespace:
    p = cli.ArgumentParser(prog="python -m longt5_jax.bench speed", description=__doc__)
    p.add_argument("--preset", default="small")
    p.add_argument("--attention", default="transient-global", choices=["local", "transient-global"])
    p.add_argument("--dtype", default="float32", help="the model's activation dtype")
    p.add_argument("--remat", default="none", choices=REMAT_POLICIES)
    p.add_argument(
        "--scaling_remat",
        default="full",
        choices=REMAT_POLICIES,
        help="remat of the length-scaling runs (16k inputs without remat need over 24 GiB)",
    )
    p.add_argument("--target_length", type=cli.positive, default=256)
    p.add_argument("--batch_size", type=cli.positive, default=1)
    p.add_argument("--race_lengths", type=cli.positive, nargs="*", default=[1024, 4096])
    p.add_argument("--race_steps", type=cli.positive, default=3, help="timed pairs per length")
    p.add_argument(
        "--settle_steps",
        type=cli.nonnegative,
        default=1,
        help="untimed steps at the start of each turn, after the other framework has run",
    )
    p.add_argument("--mfu_length", type=cli.positive, default=4096)
    p.add_argument(
        "--scaling_lengths", type=cli.positive, nargs="*", default=[1024, 2048, 8192, 16384]
    )
    p.add_argument("--scaling_reference", type=cli.positive, default=4096)
    p.add_argument("--scaling_steps", type=cli.positive, default=2, help="timed pairs per length")
    p.add_argument("--peak_size", type=cli.positive, default=2048)
    p.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    return p.parse_args(argv)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _model_flops(config: LongT5Config, args: argparse.Namespace, length: int) -> float:
    return flops.train_flops_per_step(config, args.batch_size, length, args.target_length)


def _encoder_attention_flops(config: LongT5Config, length: int, target_length: int) -> float:
    """Forward FLOPs of the blocked attention matmuls of the whole encoder on one example.

    flops.py reports attention for encoder and decoder together; one more encoder layer's
    difference isolates an encoder layer's share.
    """
    one = dataclasses.replace(config, num_encoder_layers=1)
    two = dataclasses.replace(config, num_encoder_layers=2)
    per_layer = (
        flops.model_flops(two, length, target_length).attention
        - flops.model_flops(one, length, target_length).attention
    )
    return config.num_encoder_layers * per_layer


def full_attention_flops(config: LongT5Config, args: argparse.Namespace, length: int) -> float:
    """Training FLOPs of the same model with full L x L encoder self-attention instead."""
    hk, t = config.num_heads * config.d_kv, args.target_length
    full = config.num_encoder_layers * 2 * (2 * length * length * hk)  # scores and values
    blocked = _encoder_attention_flops(config, length, t)
    if config.attention == "transient-global":  # no side keys and values to project
        g = length // config.global_block_size
        blocked += config.num_encoder_layers * 2 * (2 * g * config.d_model * hk)
    return _model_flops(config, args, length) + 3 * args.batch_size * (full - blocked)


def _turn(step, settle: int) -> float:
    """One timed step after `settle` untimed ones.

    On this kind of machine (a VM), the first step after the other framework has run spends
    several times the usual kernel time faulting in fresh memory (the same million page faults;
    docs/journal.md, "On CPU"), whichever process that framework ran in. Settling keeps that out
    of both sides' figures.
    """
    for _ in range(settle):
        step()
    return step()


def race(config: LongT5Config, args: argparse.Namespace, length: int) -> dict:
    """Alternating steps of ours and transformers' at one input length."""
    batch = ts.features(config, args.batch_size, length, args.target_length)
    ours = ts.OursStep(config, batch)
    theirs = ts.TorchProcess(config, ours.initial_params, batch, ts.cores())
    try:
        ours(), theirs()  # compile and warm up; the first losses start from the same weights
        first = (ours.losses[0], theirs.losses[0])
        times, ref_times = [], []
        for _ in range(args.race_steps):  # alternate: drift hits both alike
            times.append(_turn(ours, args.settle_steps))
            ref_times.append(_turn(theirs, args.settle_steps))
    finally:
        theirs.close()
    ratios = [r / t for r, t in zip(ref_times, times, strict=True)]
    model_flops = _model_flops(config, args, length)
    return {
        "input_length": length,
        "first_loss": first[0],
        "reference_first_loss": first[1],
        "step_s": _spread(times),
        "reference_step_s": _spread(ref_times),
        "speedup": _spread(ratios),
        "times": times,
        "reference_times": ref_times,
        "model_flops": model_flops,
        "flops_per_s": model_flops / statistics.median(times),
    }


def scaling(config: LongT5Config, args: argparse.Namespace) -> list[dict]:
    """Each length alternating with the reference length; ratios per pair."""
    batch = ts.features(config, args.batch_size, args.scaling_reference, args.target_length)
    reference = ts.OursStep(config, batch)
    reference()
    ref_flops = _model_flops(config, args, args.scaling_reference)
    rows = []
    for length in args.scaling_lengths:
        step = ts.OursStep(config, ts.features(config, args.batch_size, length, args.target_length))
        memory = hlo.memory(step.compiled)
        step()
        times, ref_times = [], []
        for _ in range(args.scaling_steps):
            times.append(step())
            ref_times.append(reference())
        ref_rate = ref_flops / statistics.median(ref_times)
        rows.append(
            {
                "input_length": length,
                "times": times,
                "reference_times": ref_times,
                "step_s": _spread(times),
                "reference_step_s": _spread(ref_times),
                "ratio_to_reference": _spread(
                    [t / r for t, r in zip(times, ref_times, strict=True)]
                ),
                "model_flops": _model_flops(config, args, length),
                "temp_bytes": memory.temporaries,
                "full_attention_flops": full_attention_flops(config, args, length),
                "full_attention_estimate_s": full_attention_flops(config, args, length) / ref_rate,
            }
        )
        del step
        gc.collect()
    all_ref = [t for r in rows for t in r["reference_times"]] or [reference()]
    rows.append(
        {
            "input_length": args.scaling_reference,
            "step_s": _spread(all_ref),
            "reference_step_s": _spread(all_ref),
            "ratio_to_reference": _spread([1.0]),
            "model_flops": ref_flops,
            "temp_bytes": hlo.memory(reference.compiled).temporaries,
            "full_attention_flops": full_attention_flops(config, args, args.scaling_reference),
            "full_attention_estimate_s": full_attention_flops(config, args, args.scaling_reference)
            / (ref_flops / statistics.median(all_ref)),
        }
    )
    return sorted(rows, key=lambda r: r["input_length"])


def _print_race(rows: list[dict]) -> None:
    print(
        f"{'input':>6} {'ours s':>8} {'hf s':>8} {'speed-up':>8} {'range':>11} "
        f"{'GFLOP/s':>8} {'loss':>8} {'hf loss':>8}"
    )
    for r in rows:
        s = r["speedup"]
        print(
            f"{r['input_length']:>6} {r['step_s']['median']:>8.2f} "
            f"{r['reference_step_s']['median']:>8.2f} {s['median']:>7.2f}x "
            f"{s['min']:>5.2f}-{s['max']:<5.2f} {r['flops_per_s'] / 1e9:>8.1f} "
            f"{r['first_loss']:>8.4f} {r['reference_first_loss']:>8.4f}",
            flush=True,
        )


def _print_scaling(rows: list[dict], reference: int) -> None:
    print(
        f"{'input':>6} {'step s':>8} {'range':>13} {'T/T(' + str(reference) + ')':>10} "
        f"{'range':>11} {'temp GiB':>8} {'full-attn est s':>15}"
    )
    for r in rows:
        s, q = r["step_s"], r["ratio_to_reference"]
        print(
            f"{r['input_length']:>6} {s['median']:>8.2f} {s['min']:>6.2f}-{s['max']:<6.2f} "
            f"{q['median']:>10.2f} {q['min']:>5.2f}-{q['max']:<5.2f} "
            f"{r['temp_bytes'] / 2**30:>8.2f} {r['full_attention_estimate_s']:>15.2f}",
            flush=True,
        )


def _plot(report: dict, out: Path) -> str | None:
    """speed.png of step time against length, or why there is none."""
    rows = report["scaling"]
    if not rows:
        return "no scaling rows: no plot"
    plt = pyplot()
    lengths = [r["input_length"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(lengths, [r["step_s"]["median"] for r in rows], "o-", label="ours (TGlobal)")
    ax.loglog(lengths, [r["full_attention_estimate_s"] for r in rows], "s--", label="full attn est")
    ax.set_xlabel("input tokens")
    ax.set_ylabel("train step s")
    ax.legend()
    save_figure(fig, out / "speed.png")
    return None


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parse(argv)
    config = LongT5Config.preset(args.preset, args.attention, dtype=args.dtype, remat=args.remat)
    print(f"{config.attention} {args.preset}, {ts.cores()} cores, device {jax.devices()[0]}")
    peak = ts.peak_matmul_flops(args.peak_size)
    print(f"peak float32 matmul: {peak['flops_per_s'] / 1e9:.1f} GFLOP/s (best of 5)", flush=True)
    race_rows = []
    if args.race_lengths and not torch_reference.available():
        print("torch/transformers not installed: no race against transformers")
    elif args.race_lengths:
        for length in args.race_lengths:
            race_rows.append(race(config, args, length))
            gc.collect()
        _print_race(race_rows)
    mfu = [
        {
            "input_length": r["input_length"],
            "model_flops_per_s": r["flops_per_s"],
            "mfu": r["flops_per_s"] / peak["flops_per_s"],
        }
        for r in race_rows
        if r["input_length"] == args.mfu_length
    ]
    for m in mfu:
        print(f"MFU at {m['input_length']}: {m['mfu']:.1%} of the measured peak")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "device": str(jax.devices()[0]),
        "cores": ts.cores(),
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "peak": peak,
        "race": race_rows,
        "mfu": mfu,
        "scaling": [],
    }
    # Written before the scaling runs too: a long input that runs out of memory keeps the race.
    write_json(out, "speed", report)
    long_config = dataclasses.replace(config, remat=args.scaling_remat)
    scaling_rows = scaling(long_config, args) if args.scaling_lengths else []
    report["scaling"] = scaling_rows
    if scaling_rows:
        _print_scaling(scaling_rows, args.scaling_reference)
    note = _plot(report, out)
    report["plot"] = note or "speed.png"
    write_json(out, "speed", report)
    if note:
        print(note)
    return 0
