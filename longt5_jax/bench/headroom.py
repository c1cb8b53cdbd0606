"""The encoder's attention kernels against flash attention written by others, at the same FLOPs.

How fast could the encoder's attention run on this GPU? Each query of a case (`bench kernels`'
MODEL:tglobal|local:LENGTH:BATCH, padded rows) meets 3W local keys and G side keys (W the block
length, G = LENGTH / the global block, TGlobal only): plain bidirectional attention over rows of
KEYS = 3W + G tokens, as many rows as the case has queries (round(BATCH LENGTH / KEYS)), does
nearly the same matmuls (base TGlobal 16k x 2: 23 rows of 1,408 tokens). Timed by the
device's own timeline (the profiler's trace, after a warm-up), bfloat16:
- ours: the case's layer forward and backward with the kernels, their kernels' time (forward:
  the forward kernel; forward and backward: every kernel of the family, without the XLA ops
  around them: the projections, the backward's row sums of do o, the bias tables' gradients'
  sums; the references' counts hold every kernel of theirs, row sums included);
- triton: jax's Pallas Triton flash attention (`ops.gpu.attention.mha`, its default blocks), the
  backend ours are written for, without a bias, window or side keys;
- mosaic: jax's Mosaic GPU FlashAttention-3 (`ops.gpu.attention_mgpu`: a producer warpgroup
  feeding two consumers through TMA and barriers; Hopper only), in float16 (jax 0.10's bfloat16
  mixes dtypes in its second matmul; the tensor cores' rate is the same).
Each row: forward, and forward + backward, in ms and TFLOP/s (of its own problem's matmuls:
forward 4 rows H KEYS^2 K, backward 2.5 times that). Where a reference is as slow as ours, the
backend is what holds ours; where it is faster, the gap is what ours could still gain there.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention, attention_mgpu

from longt5_jax import cli, kernel_checks
from longt5_jax.bench import kernels
from longt5_jax.bench import results as page
from longt5_jax.bench.report import write_json
from longt5_jax.errors import UsageError
from longt5_jax.estimate import compile_ahead, targets
from longt5_jax.model import LongT5Config

CASES = ["base:tglobal:16384:2", "xl:local:4096:1"]
COLUMNS = {  # the results page's table (`results.records`): forward and backward, TFLOP/s
    "case": ("case", ""), "ours": ("ours.both_tflops", ".1f"),
    "Pallas Triton mha": ("triton.both_tflops", ".1f"), "Mosaic GPU": ("mosaic.both_tflops", ".1f"),
}  # fmt: skip
BACKWARD = 2.5  # the backward's matmuls over the forward's (FlashAttention-2: 5 against 2)
NO_GPU = "bench headroom times kernels on a GPU; this process has none"


def problem(case: str) -> dict:
    """The case's shape and its plain attention's: keys a query, rows of that many tokens."""
    model, kind, length, batch = _parse(case)
    config = LongT5Config.preset(model, kind)
    w = config.block_len
    side = length // config.global_block_size if kind == "tglobal" else 0
    keys = 3 * w + side
    rows = max(1, round(batch * length / keys))
    heads, head_dim = config.num_heads, config.d_kv
    return {
        "case": case, "heads": heads, "head_dim": head_dim, "keys": keys, "rows": rows,
        "ours_gflop": 4 * batch * length * keys * heads * head_dim / 1e9,
        "gflop": 4 * rows * keys * keys * heads * head_dim / 1e9,
    }  # fmt: skip


def _dims(shape: dict) -> tuple[int, int, int, int]:
    """The plain attention's q, k, v and output shape: [rows, keys, heads, head_dim]."""
    return shape["rows"], shape["keys"], shape["heads"], shape["head_dim"]


def _parse(case: str) -> tuple[str, str, int, int]:
    parts = case.split(":")
    if (
        len(parts) != 4
        or parts[1] not in ("tglobal", "local")
        or not all(p.isdigit() for p in parts[2:])
    ):
        raise UsageError(f"--cases {case!r}: expected MODEL:tglobal|local:LENGTH:BATCH")
    try:
        LongT5Config.preset(parts[0])
    except ValueError as e:
        raise UsageError(f"--cases {case!r}: {e}") from None
    return parts[0], parts[1], int(parts[2]), int(parts[3])


def references(interpret: bool = False) -> dict:
    """{name: (dtype, attention(q, k, v))} of the kernels to time beside ours (`interpret`: the
    Triton one interpreted, which runs on a CPU; Mosaic GPU's has no interpreted form here)."""
    triton = functools.partial(attention.mha, segment_ids=None, interpret=interpret)
    if interpret:
        return {"triton": (jnp.float32, triton)}
    return {"triton": (jnp.bfloat16, triton), "mosaic": (jnp.float16, _flash_attention_3)}


def _flash_attention_3(q, k, v):
    # Its settings are made as it is traced: a jax whose TuningConfig differs fails this
    # reference alone (`measure` reports it), not the others.
    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=128, max_concurrent_steps=2,
        block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64,
    )  # fmt: skip
    return attention_mgpu.attention(q, k, v, config=config)


def _programs(attend):
    """(forward, forward and backward) of attend(q, k, v), jitted: the second takes the
    output's cotangent too."""
    forward = jax.jit(attend)

    def both(q, k, v, do):
        return jax.vjp(attend, q, k, v)[1](do)

    return forward, jax.jit(both)


def compiled(case: str, target: str) -> dict[str, list[str]]:
    """{reference: its forward and backward's custom calls} compiled without a GPU for `target`
    (a plan target): the lease's references build before it spends device time on them."""
    spec = targets.load(target)
    dims = _dims(problem(case))
    calls: dict[str, list[str]] = {}
    for name, (dtype, attend) in references().items():
        arg = jax.ShapeDtypeStruct(dims, dtype)
        text = compile_ahead.compile_on_one(_programs(attend)[1], [arg] * 4, spec).as_text()
        calls[name] = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    return calls


def _ms(run) -> float:
    """Device milliseconds of every kernel of one run()."""
    ms = sum(k["ms"] for k in kernels.kernel_times(run))
    if not ms:
        raise ValueError("the device's trace holds no kernel")
    return ms


def measure(case: str, done=lambda report: None) -> dict:
    """The case's report, `done(report)` after each kernel's timing: a reference that brings the
    process down (a new jax's Mosaic GPU) leaves what was timed before it."""
    shape = problem(case)
    report = {**shape, "device": jax.devices()[0].device_kind}
    timings = {"ours": functools.partial(_ours, case, shape)}
    timings.update(
        {n: functools.partial(_reference, shape, *ref) for n, ref in references().items()}
    )
    for name, timing in timings.items():
        try:
            report[name] = timing()
        except Exception as e:  # one this GPU or jax cannot run (Mosaic GPU's: Hopper only)
            report[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        done(report)
    return report


def _ours(case: str, shape: dict) -> dict:
    """The case's layer forward and backward in bfloat16 with the kernels: its kernels' time."""
    model, kind, length, batch = _parse(case)
    layer_case = f"{model}:{kind}:{length}:{batch}:padded"
    config, layer = kernel_checks.case_problem(layer_case)
    pallas = dataclasses.replace(config, attention_kernel="pallas")
    traced = kernels.kernel_times(lambda: kernel_checks.run_layer(pallas, *layer, "bfloat16"))
    family = kernels.family(layer_case)
    ours = {k["kernel"]: k["ms"] for k in traced if k["kernel"] in family}
    forward = [ms for name, ms in ours.items() if name.endswith("_fwd")]
    if not forward:
        raise ValueError(f"the device's trace holds no forward kernel of {sorted(family)}")
    return _timing(shape["ours_gflop"], forward[0], ours)


def _reference(shape: dict, dtype, attend) -> dict:
    q, k, v, do = (
        jax.random.normal(jax.random.key(i), _dims(shape), jnp.float32).astype(dtype)
        for i in range(4)
    )
    forward, both = _programs(attend)
    forward_ms = _ms(lambda: jax.block_until_ready(forward(q, k, v)))
    both_ms = _ms(lambda: jax.block_until_ready(both(q, k, v, do)))
    return _timing(shape["gflop"], forward_ms, {"all": both_ms})


def _timing(gflop: float, forward_ms: float, kernels_ms: dict) -> dict:
    total = sum(kernels_ms.values())
    return {
        "forward_ms": forward_ms, "both_ms": total, "kernels_ms": kernels_ms,
        "forward_tflops": gflop / forward_ms, "both_tflops": gflop * (1 + BACKWARD) / total,
    }  # fmt: skip


def _print(report: dict) -> None:
    print(
        f"{report['case']} on {report['device']}: {report['keys']} keys a query, plain attention "
        f"as {report['rows']} rows ({report['gflop']:.0f} GFLOP forward, ours "
        f"{report['ours_gflop']:.0f})"
    )
    for name in ("ours", "triton", "mosaic"):
        row = report.get(name, {})
        if "error" in row:
            print(f"  {name:<7} {row['error']}")
        else:
            print(
                f"  {name:<7} forward {row['forward_ms']:7.3f} ms {row['forward_tflops']:6.1f} "
                f"TFLOP/s   forward+backward {row['both_ms']:7.3f} ms "
                f"{row['both_tflops']:6.1f} TFLOP/s"
            )


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    p = cli.ArgumentParser(
        prog="python -m longt5_jax.bench headroom", description=__doc__.splitlines()[0]
    )
    p.add_argument("--cases", nargs="+", default=CASES, help=" ".join(CASES))
    p.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    page.add_argument(p)
    args = p.parse_args(argv)
    page.check(args.results, "headroom", argv)
    for case in args.cases:
        _parse(case)
    if jax.default_backend() != "gpu":
        raise UsageError(NO_GPU)
    reports: list[dict] = []

    def save(report):
        write_json(args.out_dir, "headroom", {"config": vars(args), "cases": [*reports, report]})

    for case in args.cases:
        reports.append(measure(case, save))
        _print(reports[-1])
    page.publish(args, "headroom", argv, page.records(reports, COLUMNS), where=page.machine())
    return 0
