"""Compile the tiny model's train step for every given parallel gin file, deviceless, for 8 nodes
x 4 A100-80GB (or `--target NAME`) with the shipped GPU options (`xla_options.GPU_OPTIONS`): data
fills the 32 GPUs, 2 accumulation microbatches, bf16 gradient reduction, the gin file's pipeline
plan, in the target's half precision (float16, with its loss scale, on a V100). Prints one JSON
line per file: the layout, its tensor groups' nodes, the bytes per device by kind, the memory.

Run in its own process by `test_gpu_compile.py`, so that a compiler crash (an XLA CHECK failure
aborts the process) fails the test naming the file instead of killing the test run.

    python tests/gpu_compile_configs.py [--target v100-32gb] configs/parallel/*.gin
"""

import json
import sys

from longt5_jax.estimate import targets
from longt5_jax.parallel.mesh import ParallelConfig

targets.prepare_environment()

from helpers import CLUSTER_SHAPE, CLUSTER_STEP  # noqa: E402

from longt5_jax import configuration  # noqa: E402
from longt5_jax.estimate import compile_ahead, hlo  # noqa: E402
from longt5_jax.model import LongT5Config  # noqa: E402


def main(paths: list[str]) -> int:
    name = "a100-80gb"
    if paths[:1] == ["--target"]:
        name, paths = paths[1], paths[2:]
    target = targets.load(name)
    devices = targets.devices(target, 8, 4)
    # Four layers per stack, so that every pipeline plan (up to 4 stages, 2 x 2 circular) divides.
    layers = dict(num_encoder_layers=4, num_decoder_layers=4)
    dtype = target.half_dtype
    config = LongT5Config.preset("tiny", "tglobal", dtype=dtype, remat="full", **layers)
    for path in paths:
        configuration.parse([path], ["ParallelConfig.data = -1"])
        parallel = configuration.build(ParallelConfig)
        print(f"compiling {path}", file=sys.stderr, flush=True)
        compiled = compile_ahead.compile_for(
            config, parallel, devices, 4, CLUSTER_SHAPE, CLUSTER_STEP
        )
        mesh = compiled.step.mesh
        tensor_nodes = [  # the nodes of each tensor group's devices
            sorted({d.process_index for d in mesh.devices[i, :, j]})
            for i in range(mesh.devices.shape[0])
            for j in range(mesh.devices.shape[2])
        ]
        row = {
            "path": path,
            "mesh": dict(mesh.shape),
            "tensor_nodes": tensor_nodes,
            "bytes": hlo.bytes_by_kind(compiled.collectives),
            "memory": compiled.memory().total,
            "dtype": dtype,
            "loss_scale": compiled.step.abstract_state.loss_scale is not None,
        }
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
