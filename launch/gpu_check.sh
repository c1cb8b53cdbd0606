#!/usr/bin/env bash
# The GPU acceptance run of the fused attention kernels, on one GPU with the project's
# dependencies importable, within BUDGET seconds (default 540), most informative first (device
# time is lent by the minute, and a run cut short by the budget keeps what it measured). STEPS
# picks and orders the sections (default "kernels launch headroom profile remat fill adafactor xla
# train rest transformers unrolled": what no lease has measured first, then what one has):
#   kernels: each kernel family against the XLA path on the GPU (forward and every gradient,
#     float32 and bfloat16; the default launch checked), each kernel's time, registers and
#     occupancy (--trace), the layer's time and kernels under each launch setting of LAUNCHES
#     and the default; with BASELINE (a folder holding another version's longt5_jax package),
#     that version's kernels on the same cases;
#   goals: bench device on the goal cases (the first two of CASES), the kernels' default launch;
#   fill: the goal models at the batch that fills the GPU (FILL), with the best launch: the
#     field's MFU figures are at such batches, and one example of xl 4k leaves the AdamW update
#     14% of the step; deviceless (H100, AdamW), xl 4k x 8 save_attention 58.0% roofline MFU in
#     51.0 GiB and x 4 save_dots 54.7% in 62.2 GiB, against x 1 save_dots' 38.3%; measured on
#     an H200 (2026-11-28) 34.7% and 36.1-36.5%, against x 1's 26.5%;
#   launch: each goal case's step with the default launch (if not yet measured), then with the
#     best of `kernels` (if that is not the default): every setting of LAUNCHES that made the
#     layers faster than the default, together where they set different kernels;
#   headroom: the encoder's kernels beside jax's own flash attention (Pallas Triton, and Mosaic
#     GPU's warp-specialised FlashAttention-3) at the same FLOPs, each forward and backward:
#     what holds the kernels, Triton or ours (`bench headroom`);
#   adafactor: the goal cases with the best launch, updated by Adafactor (the training loop's
#     default, LongT5's T5X setup; every other step is AdamW's, as the field's MFU figures are):
#     deviceless, xl 4k save_dots 274 -> 249 GB a step, roofline MFU 38.3% -> 41.2%;
#   xla: the goal cases with XLA's attention;
#   train: the trainer as users run it (the pretraining run file, whose attention_kernel "auto"
#     its first line resolves, base TGlobal on the embedded papers, 4096 -> 910, 8 a batch,
#     Adafactor): the whole loop's tokens/s and MFU, data and checkpoint included;
#   profile: a profiler trace of each case of PROFILE (the first goal case), kernel by kernel and
#     by kind (the Pallas kernels, the matmuls, the rest: what `bench roofline --goal_mfu` asks
#     of each; base 16k's step has not been broken down since its kernels changed);
#   remat: base 16k without remat and with save_dots, layers unrolled, the best launch (REMAT):
#     deviceless (H200 target, matmuls at 635 TFLOP/s) x 2 without remat moves 132.5 GB a step in
#     15.8 GiB, x 8 478.3 GB in 54.0 GiB, x 2 save_dots 139.2 GB, where the goal case (scanned,
#     save_attention) moves 156.3; for 35% MFU they ask 316, 299 and 339 TFLOP/s of the attention
#     kernels against its 456 (no matmul rerun, no scan's copies of saved activations);
#   rest: the remaining cases (kernels, unrolled where deviceless it gains: save_dots and no
#     remat; then XLA);
#   transformers: transformers' step on the first case;
#   unrolled: the goal cases with the layers unrolled (--no-scan_layers) and the best launch
#     (last: xl 4k's did not compile and run within 200 s on an H100's host, 2026-11-27).
# (Nsight Compute 2025.3 crashed profiling the JAX process on an H100: segmentation fault, and
# its profiled process lived on; `bench kernels --trace` reads registers, shared memory and
# occupancy of each kernel from the profiler's trace instead.)
# Results go to ${GPU_CHECK_OUT:-bench_out/gpu_check}: log.txt (timestamped sections), each
# benchmark's JSON, autotune/ (XLA's autotuning results, which each step after the first reads
# back: a case's variants autotune their shared matmuls once and run the same tilings), and
# gpu_check.tar.gz of all of it. CASES, KERNEL_CASES, FILL, REMAT, LAUNCHES override.
set -uo pipefail
out="${GPU_CHECK_OUT:-bench_out/gpu_check}"
# The goal cases in the remat policy fastest with the kernels (each beside XLA's attention), then
# base 16k with save_dots, then full remat.
cases="${CASES:-base:16384:2:save_attention xl:4096:1:save_dots base:16384:2:save_dots base:16384:2:full xl:4096:1:full large:4096:4:save_attention base:4096:4:none xl:16384:1:save_attention}"
kernel_cases="${KERNEL_CASES:-base:tglobal:16384:2:padded xl:local:4096:1:packed base:decoder:4096:2:padded}"
# Beside the default: the decoder's forward and dq with each query tile's keys in 4 programs
# (0.4-0.7 waves -> 1.5-2.9 at 512 targets, deviceless; on an H200 its layer's kernels 0.893 ->
# 0.851 ms, 2026-11-28, for 0.8-1.2% more bytes a step), and the decoder's dq and bias gradient
# in 4 warps, one warpgroup each, as its dkv now runs by default (on that H200 dkv 0.26 -> 0.12
# ms; deviceless dq 127 -> 154 registers, two programs an SM -> three). TGlobal's dq split ran
# slower (an H100: 1.18 -> 1.28 ms; with side keys 32 at a time, an H200: 1.20 -> 1.27) and
# Local's whole forward and dq slower than its split default (an H100): no longer re-timed. 4
# warps do not compile the encoder's backward (a boolean tile staged through shared memory).
# First, TGlobal's kernels in two programs of 8 warps an SM where one fits (deviceless, ptxas,
# base 16k): the forward with its local keys in a loop, 2 stages (156 -> 125 registers, its side
# loop's instructions unchanged); dq, dkv and the local bias gradient taking 32 keys a tile (dq
# looped too; 166 / 254 / 232 -> 121 / 105 / 128 registers), for 25-40% more instructions a key.
# The forward also in 4 warps, looped at 32 keys: three programs of 4 warps an SM (166 registers,
# 48 KiB), 12 warps where the first gives 16, each program's own barriers apart from the others'.
# Each setting runs only on the case whose kernels it sets.
fill="${FILL:-xl:4096:8:save_attention xl:4096:4:save_dots}"
remat_cases="${REMAT:-base:16384:2:none base:16384:8:none base:16384:2:save_dots}"
launches="${LAUNCHES:-encoder_attention_fwd=8:2:1:64 encoder_attention_fwd=4:2:1:32 encoder_attention_dq=8:2:1:32 encoder_attention_dkv=8:3:1:32 encoder_attention_dbias=8:2:1:32 decoder_attention_fwd=4:2:4,decoder_attention_dq=8:2:4 decoder_attention_dq=4:2 decoder_attention_dbias=4:2}"
budget="${BUDGET:-540}"
baseline="${BASELINE:-}"
mkdir -p "$out"
out=$(realpath "$out")
export PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
section() { echo "=== [$(($(date +%s) - start)) s] $*" | tee -a "$out/log.txt"; }
# run SECONDS CMD...: at most SECONDS and never past the budget, output into the log. Not
# through a pipe: a process the command leaves behind would hold it open and stall the run.
run() {
  local limit=$1
  shift
  local rest
  rest=$(left)
  ((rest < limit)) && limit=$rest
  ((limit < 20)) && { section "skipped (no time left): $*"; return 1; }
  timeout -k 10 "$limit" "$@" >> "$out/log.txt" 2>&1
}
pack() { tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"; }
trap pack EXIT

section "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv \
  2>&1 | tee -a "$out/log.txt"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, jax.devices())" 2>&1 | tee -a "$out/log.txt"
python3 -c "import longt5_jax.bench.__main__" 2>&1 | tee -a "$out/log.txt" || exit 1

# device CASE VARIANT [LAUNCH]: one step measurement; VARIANT is pallas, pallas:unrolled,
# pallas:launch (scanned, LAUNCH) or xla.
# With XLA's attention save_attention compiles to full remat's program: measured once, as full.
measured=" "
device() {
  local case=$1 variant=$2 kernel=${2%%:*} layers=--scan_layers limit=100 optimizer=adamw
  # With XLA's attention save_attention compiles to full remat's program: measured once, as full.
  [ "$kernel" = xla ] && case=${case/%:save_attention/:full}
  [[ "$measured" == *" $case/$variant/${3:-} "* ]] && return 0
  measured+="$case/$variant/${3:-} "
  # Unrolled, base 16k's step compiled for over 100 s on an H100's host, xl 4k's did not compile and
  # run within 200 s (2026-11-27).
  [ "$variant" = "${kernel}:unrolled" ] && layers=--no-scan_layers limit=200
  [ "$variant" = "${kernel}:adafactor" ] && optimizer=adafactor
  [ "$variant" = "${kernel}:fill" ] && limit=150 # 8 examples of xl 4k a step
  section "bench device $case $variant ${3:-}"
  run "$limit" python3 -m longt5_jax.bench device --no-deviceless --steps 5 --warmup 2 \
    --attention_kernel "$kernel" "$layers" --launch "${3:-}" --optimizer "$optimizer" \
    --autotune_cache "$out/autotune" --out_dir "$out/device_${variant//:/_}_${case//:/_}" \
    --cases "$case"
}

read -r first second rest <<<"$cases"
goals="$first ${second:-}"
best=""
# Deviceless, unrolling gains most without remat and with save_dots (xl 4k past 40% roofline MFU).
unrolls() { case "$1" in *:save_dots | *:none) ;; *) return 1 ;; esac; }

step_goals() { for case in $goals; do device "$case" pallas; done; }
step_xla() { for case in $goals; do device "$case" xla; done; }
step_kernels() {
  section "bench kernels"
  # The first setting is the one checked against XLA on the GPU: the default, which the steps run.
  # shellcheck disable=SC2086
  run 150 python3 -m longt5_jax.bench kernels --out_dir "$out" --repeats 5 --trace \
    --cases $kernel_cases --launch "" $launches
  best=$(python3 -c "import json; print(json.load(open('$out/kernels.json')).get('best_launch') or '')" 2>/dev/null)
  section "best launch: '${best}'"
  if [ -n "$baseline" ]; then
    section "bench kernels, baseline $baseline"
    # shellcheck disable=SC2086
    (cd "$baseline" && run 80 python3 -m longt5_jax.bench kernels --out_dir "$out/baseline" \
      --repeats 5 --cases ${kernel_cases% *})
  fi
}
# Each goal case's step with the best launch, beside the default's.
step_launch() {
  for case in $goals; do
    device "$case" pallas
    [ -n "$best" ] && device "$case" pallas:launch "$best"
  done
}
step_headroom() {
  section "bench headroom"
  run 90 python3 -m longt5_jax.bench headroom --out_dir "$out"
}
step_fill() { for case in $fill; do device "$case" pallas:fill "$best"; done; }
step_adafactor() { for case in $goals; do device "$case" pallas:adafactor "$best"; done; }
step_unrolled() { for case in $goals; do device "$case" pallas:unrolled "$best"; done; }
step_remat() { for case in $remat_cases; do device "$case" pallas:unrolled "$best"; done; }
step_profile() {
  local dir model length batch remat # read from each case: not the script's own names
  for case in ${PROFILE:-$first}; do
    section "profile of $case with the kernels"
    IFS=: read -r model length batch remat <<<"$case"
    dir="$out/profile_${case//:/_}"
    run 90 python3 -m longt5_jax.bench profile --preset "$model" --input_length "$length" \
      --batch_size "$batch" --remat "$remat" --dtype bfloat16 --target_length 512 \
      --attention_kernel pallas --launch "$best" --top 30 --out_dir "$dir"
    find "$dir" -name "*.trace.json.gz" -exec cp {} "$dir/step.trace.json.gz" \;
    rm -rf "$dir/profile_trace" "$dir/profile_hlo.txt"
  done
}
step_rest() {
  for case in ${rest:-}; do
    device "$case" pallas "$best"
    unrolls "$case" && device "$case" pallas:unrolled "$best"
    device "$case" xla
  done
}
step_train() {
  section "train: runs/pretrain.gin, base TGlobal, 4096 -> 910 x 8"
  rm -rf "$out/train"
  run 150 python3 -m longt5_jax.train --gin_file=configs/runs/pretrain.gin \
    --gin_file=configs/models/base_tglobal.gin --gin_file=configs/data/aclsum_pretrain.gin \
    --gin.MODEL_DIR="'$out/train'" --gin.RunConfig.train_steps=24 --gin.RunConfig.log_every=4 \
    --gin.RunConfig.peak_flops_per_device=989e12
  rm -rf "$out/train/checkpoints" # the parameters are not a result
}
step_transformers() {
  section "transformers on $first"
  run 90 python3 -m longt5_jax.bench device --no-deviceless --steps 3 --warmup 1 \
    --transformers --attention_kernel pallas --launch "$best" --autotune_cache "$out/autotune" \
    --out_dir "$out/transformers" --cases "$first"
}
for step in ${STEPS:-kernels launch headroom profile remat fill adafactor xla train rest transformers unrolled}; do
  "step_$step"
done
section "done"
