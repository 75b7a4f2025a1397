#!/usr/bin/env bash
# Wheels for running benchmarks/bench_train_step.py on a GPU machine that has torch but no DeepSpeed and
# cannot reach PyPI (this workplace's lent H100/H200 machines: Python 3.12, torch, transformers, numpy,
# pyyaml, tqdm, einops, msgpack, ninja, psutil, py-cpuinfo, nvidia-ml-py already installed).
#
#   bash benchmarks/gpu_wheels.sh            # here: fills .whl/ (git-ignored), prints the command to run there
#
# DeepSpeed is built here as a pure-Python wheel (DS_BUILD_OPS=0: its CUDA ops, FusedAdam among them, are
# JIT-compiled there on first use with the machine's nvcc and ninja). Its other missing requirements
# (pydantic and friends, hjson) and the project's runtime dependencies the image lacks (ftfy, wcwidth,
# datasketch for the corpus code; evaluate with datasets, dill, multiprocess for `python -m evaluation`) are
# downloaded as CPython 3.12 manylinux wheels, versions pinned to what this project's .venv resolved, so the
# two sides run the same code. With them `python -m scripts.gpu_check --data DIR` runs every check there
# (DIR: a copy of ../shared/data inside the checkout, e.g. a git-ignored .gpudata/, since only the
# checkout travels). Run of 2026-11-26 on one H200: benchmarks/RESULTS.md, "Training step (GPU)".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "error: $PY not found: run 'bash scripts/setup_env.sh' first" >&2; exit 1; }
version() { "$PY" -c "from importlib.metadata import version; print(version('$1'))"; }

rm -rf .whl.tmp && mkdir -p .whl.tmp
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl.tmp "deepspeed==$(version deepspeed)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl.tmp "pydantic==$(version pydantic)" "pydantic-core==$(version pydantic-core)" \
  "annotated-types==$(version annotated-types)" "typing-inspection==$(version typing-inspection)" \
  "hjson==$(version hjson)" "ftfy==$(version ftfy)" "wcwidth==$(version wcwidth)" \
  "datasketch==$(version datasketch)" "evaluate==$(version evaluate)" "datasets==$(version datasets)" \
  "dill==$(version dill)" "multiprocess==$(version multiprocess)"
rm -rf .whl && mv .whl.tmp .whl
ls -l .whl
cat <<'EOF'

Carry .whl to the GPU machine and run (repository root):
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD && PYTHONUNBUFFERED=1 python3 -m benchmarks.bench_train_step \
    --device cuda --dtype fp16 --preset gpt2-1.2b --reps 5 --steps 5
EOF
