"""python -m longt5_jax.bench NAME [options]: cluster, data, decode, device, headroom, kernels,
memory, offload, pipeline, profile, roofline, sass, scaling, speed, strategy.

Each benchmark takes --help.
"""

import sys

from longt5_jax import cli
from longt5_jax.bench import (
    cluster,
    data,
    decode,
    device,
    headroom,
    kernels,
    memory,
    offload,
    pipeline,
    profile,
    roofline,
    sass,
    scaling,
    speed,
    strategy,
)
from longt5_jax.errors import UsageError

BENCHMARKS = {
    "cluster": cluster.main,
    "data": data.main,
    "decode": decode.main,
    "device": device.main,
    "headroom": headroom.main,
    "kernels": kernels.main,
    "memory": memory.main,
    "offload": offload.main,
    "pipeline": pipeline.main,
    "profile": profile.main,
    "roofline": roofline.main,
    "sass": sass.main,
    "scaling": scaling.main,
    "speed": speed.main,
    "strategy": strategy.main,
}


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        given = repr(argv[0]) if argv else "none"
        raise UsageError(f"benchmark {given}: expected one of {', '.join(BENCHMARKS)}")
    return BENCHMARKS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
