"""Compile the tiny model's train step for every given parallel gin file, deviceless, for 8 nodes
x 4 A100-80GB with the shipped GPU options (`xla_options.GPU_OPTIONS`): data fills the 32 GPUs,
2 accumulation microbatches, the gin file's pipeline plan. Run in its own process by
`test_gpu_compile.py`, so that a compiler crash (an XLA CHECK failure aborts the process) fails
the test naming the file instead of killing the test run.

    python tests/gpu_compile_configs.py configs/parallel/*.gin
"""

import sys

from longt5_jax.plan import targets

targets.prepare_environment()

from longt5_jax import configuration  # noqa: E402
from longt5_jax.model import LongT5Config  # noqa: E402
from longt5_jax.plan import compile_ahead  # noqa: E402
from longt5_jax.step import StepConfig  # noqa: E402


def main(paths: list[str]) -> int:
    devices = targets.devices(targets.load("a100-80gb"), 8, 4)
    # Four layers per stack, so that every pipeline plan (up to 4 stages, 2 x 2 circular) divides.
    layers = dict(num_encoder_layers=4, num_decoder_layers=4)
    config = LongT5Config.preset("tiny", "tglobal", dtype="bfloat16", **layers)
    for path in paths:
        configuration.parse([path], ["MeshConfig.data = -1"])
        plan = configuration.build(configuration.MeshConfig)
        print(f"compiling {path}", flush=True)
        compiled = compile_ahead.compile_for(
            config, plan, devices, 4, (128, 64, 16), StepConfig(microbatches=2)
        )
        print(f"compiled {path}: {compiled.memory().total} bytes per device", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
