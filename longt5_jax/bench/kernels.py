"""The fused encoder attention against the XLA path it replaces, on this machine's backend.

Each case is one encoder attention layer (projections included: `LongSelfAttention`) of a
published size, with random parameters and padded or packed rows. For float32 and bfloat16 it
reports the output's and every gradient's largest error relative to the largest value of the
float32 XLA path (padding rows excluded: the model masks them downstream), and the time of the
layer's forward and backward with each kernel (median of the timed runs after a warm-up). On a
GPU the kernels are Triton; elsewhere they are interpreted (use small cases there).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import numpy as np

from longt5_jax import cli
from longt5_jax.bench.report import write_json

CASES = ["base:tglobal:4096:2:padded", "base:tglobal:16384:1:packed", "xl:local:4096:1:padded"]


def parse_case(text: str) -> tuple[str, str, int, int, bool]:
    parts = text.split(":")
    ok = len(parts) == 5 and parts[2].isdigit() and parts[3].isdigit()
    if not ok or parts[4] not in ("padded", "packed") or parts[1] not in ("tglobal", "local"):
        raise cli.UsageError(
            f"--cases {text!r}: expected MODEL:tglobal|local:LENGTH:BATCH:padded|packed"
        )
    return parts[0], parts[1], int(parts[2]), int(parts[3]), parts[4] == "packed"


def rows(batch: int, length: int, packed: bool, rng) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions): the first row full, the others padded to random lengths; packed
    rows hold up to four segments."""
    seg = np.zeros((batch, length), np.int32)
    pos = np.zeros((batch, length), np.int32)
    for b in range(batch):
        end = int(rng.integers(length // 2, length + 1)) if b else length
        bounds = [0, end]
        if packed:
            cuts = rng.choice(np.arange(1, end), size=min(3, end - 1), replace=False)
            bounds = [0, *np.sort(cuts).tolist(), end]
        for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            seg[b, lo:hi] = s + 1
            pos[b, lo:hi] = np.arange(hi - lo)
    return seg, pos


def layer_problem(config, batch: int, length: int, packed: bool, seed: int = 0):
    """(params, inputs, cotangent) of one attention layer: random parameters, tables and input."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from longt5_jax.model.long_attention import LongSelfAttention, global_blocks

    rng = np.random.default_rng(seed)
    seg, pos = rows(batch, length, packed, rng)
    tglobal = config.attention == "transient-global"
    h, r = config.num_heads, config.relpos_buckets
    inputs = {
        "x": jnp.asarray(rng.normal(size=(batch, length, config.d_model)), jnp.float32),
        "seg": jnp.asarray(seg),
        "blocks": global_blocks(jnp.asarray(seg), jnp.asarray(pos), config.global_block_size)
        if tglobal
        else None,
        "local_table": jnp.asarray(rng.normal(size=(h, r)), jnp.float32),
        "side_table": jnp.asarray(rng.normal(size=(h, r)), jnp.float32) if tglobal else None,
    }
    w = config.block_len
    args = (inputs["x"], inputs["seg"], jnp.zeros((h, w, 3 * w)), inputs["blocks"])
    layer = LongSelfAttention(config, True)
    params = nn.unbox(layer.init(jax.random.key(seed), *args, inputs["side_table"]))["params"]
    # Perturbed in proportion to each parameter's spread: an absolute perturbation at d_model 768
    # makes logits of hundreds, a one-hot softmax and q, k gradients that are zero up to rounding.
    noise = jax.random.key(seed + 1)
    params = jax.tree.map(
        lambda a: a
        + 0.3 * jnp.where(a.std() > 0, a.std(), 1.0) * jax.random.normal(noise, a.shape),
        params,
    )
    real = jnp.asarray(seg > 0)[..., None]
    cotangent = jnp.asarray(rng.normal(size=inputs["x"].shape), jnp.float32) * real
    return params, inputs, cotangent


@functools.cache
def layer_grad(config):
    """jit(params, x, local table, side table, inputs, cotangent) -> (output, gradients)."""
    import jax
    import jax.numpy as jnp

    from longt5_jax.model import relpos
    from longt5_jax.model.long_attention import LongSelfAttention, relative_positions_3block

    layer = LongSelfAttention(config, True)
    rel = relative_positions_3block(config.block_len)
    buckets = relpos.relative_position_bucket(
        rel, True, config.relpos_buckets, config.relpos_max_distance
    )

    def loss(params, x, local_table, side_table, seg, blocks, cotangent):
        local_bias = relpos.lookup(local_table, buckets)
        out = layer.apply({"params": params}, x, seg, local_bias, blocks, side_table)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def run_layer(config, params, inputs, cotangent, dtype: str = "float32"):
    """(output, gradients) of the layer with `config` in `dtype` (inputs cast to it)."""
    import jax
    import jax.numpy as jnp

    config = dataclasses.replace(config, dtype=dtype)
    x = inputs["x"].astype(jnp.dtype(dtype))
    (_, out), grads = layer_grad(config)(
        params,
        x,
        inputs["local_table"],
        inputs["side_table"],
        inputs["seg"],
        inputs["blocks"],
        cotangent,
    )
    return jax.block_until_ready((out, grads))


def relative_errors(got, want, real) -> dict[str, float]:
    """Largest |got - want| over the largest |want|, for the output (real rows) and each
    gradient, by key path."""
    import jax
    import jax.numpy as jnp

    def err(g, w):
        g, w = jnp.asarray(g, jnp.float32), jnp.asarray(w, jnp.float32)
        scale = float(jnp.max(jnp.abs(w)))
        return float(jnp.max(jnp.abs(g - w))) / scale if scale else float(jnp.max(jnp.abs(g)))

    out = {"output": err(got[0] * real, want[0] * real)}
    flat, _ = jax.tree.flatten_with_path(want[1])
    for (path, w), g in zip(flat, jax.tree.leaves(got[1]), strict=True):
        out["grad" + jax.tree_util.keystr(path)] = err(g, w)
    return out


def _time(config, params, inputs, cotangent, repeats: int) -> float:
    """Median seconds of the layer's forward and backward in bfloat16 (after one warm-up)."""
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        run_layer(config, params, inputs, cotangent, "bfloat16")
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def measure(case: str, repeats: int) -> dict:
    import jax

    from longt5_jax.model import LongT5Config

    model, attention, length, batch, packed = parse_case(case)
    xla = LongT5Config.preset(model, attention)
    pallas = dataclasses.replace(xla, attention_kernel="pallas")
    params, inputs, cotangent = layer_problem(xla, batch, length, packed)
    real = inputs["seg"][..., None] > 0
    reference = run_layer(xla, params, inputs, cotangent)
    report = {
        "case": case,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
    }
    report["pallas_float32"] = relative_errors(
        run_layer(pallas, params, inputs, cotangent), reference, real
    )
    for name, config in (("xla", xla), ("pallas", pallas)):
        low = run_layer(config, params, inputs, cotangent, "bfloat16")
        report[f"{name}_bfloat16"] = relative_errors(low, reference, real)
        if repeats:
            report[f"{name}_seconds"] = _time(config, params, inputs, cotangent, repeats)
    return report


def _print(report: dict) -> None:
    worst = {k: max(v.values()) for k, v in report.items() if isinstance(v, dict)}
    line = "  ".join(f"{k} {v:.1e}" for k, v in worst.items())
    print(f"{report['case']:32} worst relative error: {line}")
    if "xla_seconds" in report:
        x, p = report["xla_seconds"], report["pallas_seconds"]
        print(f"{'':32} fwd+bwd bf16: xla {x * 1e3:.2f} ms, pallas {p * 1e3:.2f} ms ({x / p:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m longt5_jax.bench kernels", description=__doc__.splitlines()[0]
    )
    p.add_argument("--cases", nargs="+", default=CASES, help=CASES[0])
    p.add_argument("--repeats", type=int, default=10, help="timed runs per kernel (0: none)")
    p.add_argument("--out_dir", default="bench_out")
    args = p.parse_args(argv)
    for case in args.cases:
        parse_case(case)
    if args.repeats < 0:
        raise cli.UsageError(f"--repeats {args.repeats}: expected >= 0")
    reports = []
    for case in args.cases:
        reports.append(measure(case, args.repeats))
        _print(reports[-1])
    write_json(args.out_dir, "kernels", {"config": vars(args), "cases": reports})
    return 0
