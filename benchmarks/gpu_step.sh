#!/usr/bin/env bash
# The GPU step A/B of issue 27 in one prepared run (a lent GPU machine's device time is short): on one GPU,
#   1. the paper's 1.2B GPT-2 (fp16, micro-batch 8, FusedAdam as the trainer picks it): ours with the O(1)
#      optimizer step, ours with DeepSpeed's own step, HF GPT2LMHeadModel, interleaved in one process; then
#      kernel launches and host syncs per step (torch.profiler and benchmarks.host_work);
#   2. the trainer itself on configs/gpt2_1.2b.yaml: micro-batch 4 with full recompute (the config), 8 and 16
#      without (scripts/gpu_check.py --bench-1p2b);
#   3. the same A/B in bf16, and 4. fp16 with torch's fused AdamW instead of FusedAdam (ours only).
# Each stage writes $OUT/<stage>.txt (default: runs/gpu_step/) and has its own time limit, so a slow stage
# costs only itself. Needs DeepSpeed importable (benchmarks/gpu_wheels.sh) and a data folder with
# corpus/tinyshakespeare.txt and tokenizers/gpt2/ (DATA, default ../shared/data).
#   bash benchmarks/gpu_step.sh                        # on the GPU machine
#   GPU_STEP_DEVICE=cpu bash benchmarks/gpu_step.sh    # anywhere: the same stages on a tiny model, on CPU
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-runs/gpu_step}
DATA=${DATA:-../shared/data}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${GPU_STEP_DEVICE:-cuda}" = cpu ]; then
  export DS_ACCELERATOR=cpu
  shape=(--device cpu --layers 2 --hidden 64 --heads 4 --seq 32 --batch 2 --vocab 300 --reps 2 --steps 2 --warmup 1)
  fp16=(--dtype fp16)
  stage2=0
else
  shape=(--device cuda --preset gpt2-1.2b --reps 3 --steps 4 --warmup 2)
  fp16=(--dtype fp16)
  stage2=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
fi
stage() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  [ "$limit" = 0 ] && return 0  # LIMIT_...=0 skips a stage
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt"
  grep -E '^\| |^O\(1\)|^Speed-up|^- model|^Host work|^- model FLOPs' "$OUT/$name.txt" | head -40
}
stage fp16_ab "${LIMIT_AB:-240}" "$PY" -m benchmarks.bench_train_step "${shape[@]}" "${fp16[@]}" --step-ab --counts 2
if [ "$stage2" = 1 ]; then
  stage trainer_1p2b "${LIMIT_TRAINER:-200}" "$PY" -m scripts.gpu_check --bench-1p2b "$OUT/trainer_1p2b.json" --data "$DATA"
  cat "$OUT/trainer_1p2b.json" 2>/dev/null; echo
fi
stage bf16_ab "${LIMIT_BF16:-110}" "$PY" -m benchmarks.bench_train_step "${shape[@]}" --dtype bf16 --step-ab --only ours
stage fp16_torch_adamw "${LIMIT_TORCH:-110}" "$PY" -m benchmarks.bench_train_step "${shape[@]}" "${fp16[@]}" --adam torch \
  --step-ab --only ours
