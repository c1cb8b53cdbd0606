"""python -m longt5_jax.bench NAME [options]: cluster, data, decode, device, memory, offload,
pipeline, profile, speed, strategy.

Each benchmark takes --help.
"""

import sys

from longt5_jax.bench import (
    cluster,
    data,
    decode,
    device,
    memory,
    offload,
    pipeline,
    profile,
    speed,
    strategy,
)

BENCHMARKS = {
    "cluster": cluster.main,
    "data": data.main,
    "decode": decode.main,
    "device": device.main,
    "memory": memory.main,
    "offload": offload.main,
    "pipeline": pipeline.main,
    "profile": profile.main,
    "speed": speed.main,
    "strategy": strategy.main,
}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        print(
            f"usage: python -m longt5_jax.bench {{{','.join(BENCHMARKS)}}} [options]",
            file=sys.stderr,
        )
        return 2
    return BENCHMARKS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
