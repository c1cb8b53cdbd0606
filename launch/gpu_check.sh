#!/usr/bin/env bash
# The GPU acceptance run of the fused attention kernels, on one GPU with the project's
# dependencies importable, within BUDGET seconds (default 540):
#   1. bench kernels: each kernel family against the XLA path (forward and every gradient,
#      float32 and bfloat16) and the layer's time under several Triton launch settings;
#   2. bench device: the train step with the kernels (launched with the fastest setting of 1)
#      and with XLA's attention, case by case over CASES;
#   3. transformers' step on the first case, and a profile of the first case with the kernels,
#      if time is left.
# Results go to ${GPU_CHECK_OUT:-bench_out/gpu_check}: log.txt (timestamped sections) and each
# step's JSON. CASES and KERNEL_CASES override the cases.
set -uo pipefail
out="${GPU_CHECK_OUT:-bench_out/gpu_check}"
cases="${CASES:-base:16384:2:full xl:4096:1:full large:4096:4:full base:4096:4:none xl:16384:1:full}"
kernel_cases="${KERNEL_CASES:-base:decoder:4096:2:padded base:tglobal:16384:2:padded xl:local:4096:1:packed}"
budget="${BUDGET:-540}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
section() { echo "=== [$(($(date +%s) - start)) s] $*" | tee -a "$out/log.txt"; }
# run SECONDS CMD...: at most SECONDS and never past the budget, output into the log.
run() {
  local limit=$1
  shift
  local rest
  rest=$(left)
  ((rest < limit)) && limit=$rest
  ((limit < 20)) && { section "skipped (no time left): $*"; return 1; }
  timeout "$limit" "$@" 2>&1 | tee -a "$out/log.txt"
}

section "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$out/log.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$out/log.txt"

section "bench kernels"
# shellcheck disable=SC2086
run 180 python3 -m longt5_jax.bench kernels --out_dir "$out" --repeats 3 \
  --cases $kernel_cases --launch "" "encoder_*=8:2" "encoder_*=8:4" "decoder_*=8:3"
best=$(python3 -c "import json; print(json.load(open('$out/kernels.json')).get('best_launch') or '')" 2>/dev/null)
section "fastest launch: '${best}'"

first="${cases%% *}"
# Case by case, kernels then XLA, so that a run cut short by the budget still pairs them.
for case in $cases; do
  for kernel in pallas xla; do
    section "bench device $case $kernel"
    run 100 python3 -m longt5_jax.bench device --no-deviceless --steps 5 --warmup 2 \
      --attention_kernel "$kernel" --launch "$best" --out_dir "$out/device_${kernel}_${case//:/_}" \
      --cases "$case"
  done
done

section "transformers on $first"
run 60 python3 -m longt5_jax.bench device --no-deviceless --steps 3 --warmup 1 --transformers \
  --attention_kernel pallas --launch "$best" --out_dir "$out/transformers" --cases "$first"

section "profile of $first with the kernels"
IFS=: read -r model length batch remat <<<"$first"
run 90 python3 -m longt5_jax.bench profile --preset "$model" --input_length "$length" \
  --batch_size "$batch" --remat "$remat" --dtype bfloat16 --target_length 512 \
  --attention_kernel pallas --top 30 --out_dir "$out/profile"
rm -rf "$out/profile/profile_trace" "$out/profile/profile_hlo.txt"
section "done"
