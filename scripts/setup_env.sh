#!/usr/bin/env bash
# Creates .venv with what the project needs, on a fresh machine, offline apart from PyPI.
#   bash scripts/setup_env.sh [--extras test] [--torch-index-url URL|cpu|default] [--no-constraints]
# Idempotent: a finished venv with the same inputs and (at least) the requested extras is reused.
# The main job (scripts/run_main.sh) asks for the runtime only; the tests (scripts/test.sh) for "test".
# Order matters:
#   1. torch, from the source scripts/torch_source.py picks: a torch already in the venv that satisfies
#      the bound is kept; else TORCH_INDEX_URL / --torch-index-url; else the default (CUDA) build on a
#      machine with an NVIDIA GPU and PyTorch's CPU wheel index without one (pip's own configuration,
#      e.g. a local wheel in find-links, where that index cannot be reached). Version: constraints.txt.
#   2. DeepSpeed as its docs recommend: after torch, plain `pip install deepspeed` (ops JIT-compiled on
#      first use). With DS_BUILD_OPS=1 (pre-compiled ops) it is built without build isolation, against
#      the torch of step 1.
#   3. the project itself, editable, with the requested extras, under constraints.txt (the versions CI
#      tested; torch's line replaced by the torch actually installed).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
EXTRAS=""
USE_CONSTRAINTS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --extras) EXTRAS=$2; shift 2 ;;
    --torch-index-url) export TORCH_INDEX_URL=$2; shift 2 ;;
    --no-constraints) USE_CONSTRAINTS=0; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "setup_env: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
pin() { sed -n "s/^$1==\([^ ;#]*\).*/\1/p" constraints.txt | head -n1; }
TORCH_VERSION=${TORCH_VERSION:-$(pin torch)}
DEEPSPEED_VERSION=${DEEPSPEED_VERSION:-$(pin deepspeed)}

# The marker records the inputs' hash and the extras installed; a request for a subset is satisfied.
INPUTS=$(cat pyproject.toml constraints.txt scripts/setup_env.sh scripts/torch_source.py | sha256sum | cut -d' ' -f1)
INPUTS="$INPUTS ${TORCH_INDEX_URL:-} $USE_CONSTRAINTS"
if [ -f "$VENV/.complete" ] && [ "$(head -n1 "$VENV/.complete")" = "$INPUTS" ]; then
  have=$(sed -n 2p "$VENV/.complete")
  missing=0
  for e in ${EXTRAS//,/ }; do case ",$have," in *",$e,"*) ;; *) missing=1 ;; esac; done
  [ "$missing" = 0 ] && exit 0
  EXTRAS=$(printf '%s\n' ${have//,/ } ${EXTRAS//,/ } | sort -u | paste -sd, -)
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
$PIP install -q --upgrade "pip>=24" setuptools wheel

plan=$("$VENV/bin/python" scripts/torch_source.py)
read -r action index <<< "$plan"
if [ "$action" = install ]; then
  if [ "$index" = default ]; then
    $PIP install -q "torch==${TORCH_VERSION}"
  else
    $PIP install -q --index-url "$index" "torch==${TORCH_VERSION}"
  fi
fi
torch_installed=$("$VENV/bin/python" -c "from importlib.metadata import version; print(version('torch'))")

if [ "${DS_BUILD_OPS:-0}" = 1 ]; then
  $PIP install -q --no-build-isolation "deepspeed==${DEEPSPEED_VERSION}"
else
  $PIP install -q "deepspeed==${DEEPSPEED_VERSION}"
fi

CONSTRAINT_ARGS=()
if [ "$USE_CONSTRAINTS" = 1 ]; then
  # the tested versions, except torch: the one installed above (kept or chosen for this machine) stays
  { grep -v -E '^torch==' constraints.txt; echo "torch==${torch_installed}"; } > "$VENV/constraints.txt"
  CONSTRAINT_ARGS=(-c "$VENV/constraints.txt")
fi
$PIP install -q ${CONSTRAINT_ARGS[@]+"${CONSTRAINT_ARGS[@]}"} -e ".${EXTRAS:+[$EXTRAS]}"
printf '%s\n%s\n' "$INPUTS" "$EXTRAS" > "$VENV/.complete"
echo "environment ready: $VENV (torch ${torch_installed}, extras: ${EXTRAS:-none})"
