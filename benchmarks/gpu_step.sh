#!/usr/bin/env bash
# The GPU step A/B of issue 27 in one prepared run (a lent GPU machine's device time is short): on one GPU,
#   fp16_ab       the paper's 1.2B GPT-2 (fp16, micro-batch 8, FusedAdam as the trainer picks it): ours with the O(1)
#                 optimizer step, ours with DeepSpeed's own step, HF GPT2LMHeadModel, interleaved in one process;
#                 then kernel launches and host syncs per step (torch.profiler and benchmarks.host_work);
#   trainer_1p2b  the trainer itself on configs/gpt2_1.2b.yaml: micro-batch 4 with full recompute, 8 and 16
#                 without (python -m scripts.gpu_check --bench-1p2b; GPU only; HF at micro-batch 8 is fp16_ab's row);
#   bf16_ab       bf16 vs fp16 (ours, torch's fused AdamW in both) and bf16's O(1) vs DeepSpeed step, one process;
#   adam_ab       FusedAdam vs torch's fused AdamW (ours, fp16, O(1) step), one process (GPU only: FusedAdam is a
#                 CUDA kernel);
#   compile_ab    eager vs compiled layers (model.compile, one graph per layer; ours, fp16), one process.
# Each stage writes $OUT/<stage>.txt (default: runs/gpu_step/) and has its own time limit (LIMIT_<STAGE>=0 skips
# it), so a slow stage costs only itself; GPU_STEP_STAGES="fp16_ab compile_ab" runs only the stages named. Needs
# DeepSpeed importable (benchmarks/gpu_wheels.sh) and a data folder with corpus/tinyshakespeare.txt and
# tokenizers/gpt2/ (DATA, default ../shared/data).
#   bash benchmarks/gpu_step.sh                        # on the GPU machine
#   GPU_STEP_DEVICE=cpu bash benchmarks/gpu_step.sh    # anywhere: the same stages on a tiny model, on CPU (~3 min)
#   GPU_STEP_DEVICE=cpu GPU_STEP_STAGES=fp16_ab bash benchmarks/gpu_step.sh   # short: one stage (CI)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-runs/gpu_step}
DATA=${DATA:-../shared/data}
STAGES=" ${GPU_STEP_STAGES:-fp16_ab trainer_1p2b bf16_ab adam_ab compile_ab} "
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${GPU_STEP_DEVICE:-cuda}" = cpu ]; then
  export DS_ACCELERATOR=cpu
  shape=(--device cpu --layers 2 --hidden 64 --heads 4 --seq 32 --batch 2 --vocab 300 --reps 2 --steps 2 --warmup 1)
  gpu=0
else
  shape=(--device cuda --preset gpt2-1.2b --reps 3 --steps 4 --warmup 2)
  gpu=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
fi
stage() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  [[ "$STAGES" == *" $name "* ]] || return 0
  [ "$limit" = 0 ] && return 0  # LIMIT_...=0 skips a stage
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt"
  grep -E '^\| |^O\(1\)|^Speed-up|^Compiled|^fp16 vs|^bf16 vs|^FusedAdam vs|^torch AdamW vs|^- model|^Host work|^ours \(compiled\): n/a' \
    "$OUT/$name.txt" | head -40
}
bench=("$PY" -m benchmarks.bench_train_step "${shape[@]}")
stage fp16_ab "${LIMIT_AB:-240}" "${bench[@]}" --dtype fp16 --step-ab --counts 2
if [ "$gpu" = 1 ]; then
  stage trainer_1p2b "${LIMIT_TRAINER:-240}" "$PY" -m scripts.gpu_check --bench-1p2b "$OUT/trainer_1p2b.json" --data "$DATA"
  [[ "$STAGES" == *" trainer_1p2b "* ]] && { cat "$OUT/trainer_1p2b.json" 2>/dev/null; echo; }
fi
stage bf16_ab "${LIMIT_BF16:-150}" "${bench[@]}" --dtype bf16 --dtype-ab fp16 --adam torch --step-ab --only ours --counts 2
if [ "$gpu" = 1 ]; then
  stage adam_ab "${LIMIT_ADAM:-120}" "${bench[@]}" --dtype fp16 --adam fused --adam-ab --only ours --counts 2
elif [[ "$STAGES" == *" adam_ab "* ]]; then
  echo "== adam_ab: skipped on CPU (DeepSpeed's FusedAdam is a CUDA kernel)" | tee "$OUT/adam_ab.txt"
fi
stage compile_ab "${LIMIT_COMPILE:-240}" "${bench[@]}" --dtype fp16 --compile --only ours --counts 2
