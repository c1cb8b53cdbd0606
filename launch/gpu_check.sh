#!/usr/bin/env bash
# The GPU acceptance run of the fused attention kernels, on one GPU with the project's
# dependencies importable: the kernels against the XLA path (bench kernels: forward and every
# gradient, float32 and bfloat16, and the layer's time), then the train step with each kernel
# (bench device). Results go to ${GPU_CHECK_OUT:-bench_out/gpu_check}; CASES overrides the cases.
set -uo pipefail
out="${GPU_CHECK_OUT:-bench_out/gpu_check}"
mkdir -p "$out"
cases="${CASES:-base:16384:2:full xl:4096:1:full}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
timeout 240 python3 -m longt5_jax.bench kernels --out_dir "$out" --repeats 10 \
  --cases base:tglobal:4096:2:padded xl:local:4096:1:packed 2>&1 | tee "$out/kernels.txt"
for kernel in pallas xla; do
  # shellcheck disable=SC2086
  timeout 300 python3 -m longt5_jax.bench device --no-deviceless --steps 5 --warmup 2 \
    --attention_kernel "$kernel" --out_dir "$out/device_$kernel" --cases $cases \
    2>&1 | tee "$out/device_$kernel.txt"
done
