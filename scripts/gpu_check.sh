#!/usr/bin/env bash
# GPU smoke suite (see scripts/gpu_check/, run as python -m scripts.gpu_check): on a machine with NVIDIA GPUs, installs what is missing,
# then runs TP=1/2 GPT-2 fp16+bf16, PP=2, BERT, RACE, WikiText-103, LAMBADA, stop-and-resume, HF export
# and the 1.2B config, the Llama-style 1B config (configs/llama_1b.yaml, bf16, MFU), and prints one table.
#   bash scripts/gpu_check.sh [--gpus N] [--only NAME ...] [--steps 30] [--data ../shared/data]
#   bash scripts/gpu_check.sh --cpu-dry-run      # anywhere: argument parsing, the plan, the table
# PYTHON=... picks the interpreter (default: .venv/bin/python if present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

if [[ " $* " != *" --cpu-dry-run "* ]]; then
  command -v nvidia-smi >/dev/null 2>&1 || { echo "gpu_check: nvidia-smi not found: this needs an NVIDIA GPU machine (or use --cpu-dry-run)" >&2; exit 2; }
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu_check: $PY's torch has no CUDA: install a CUDA build of torch first" >&2; exit 2; }
  # the project and its requirements (a CUDA torch already present is kept); ninja for DeepSpeed's JIT
  # FusedAdam kernel, transformers for the HF export check
  if ! "$PY" -c "import deepspeed, transformers, sentencepiece, datasets, evaluate, ftfy, datasketch" >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-build-isolation -e . ninja transformers
  fi
  "$PY" -m pip install -q ninja >/dev/null 2>&1 || true
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m scripts.gpu_check "$@"
