#!/usr/bin/env bash
# Creates .venv with everything the project needs, on a fresh machine, offline apart from PyPI.
#   bash scripts/setup_env.sh            # idempotent: a finished venv is reused
# Order matters:
#   1. torch is pinned to the 2.13.0 CPU build first (a bare `torch` pulls several GB of CUDA packages);
#   2. deepspeed ships only an sdist whose setup.py imports torch, so it is built without build
#      isolation against the torch installed in step 1 (otherwise pip would fetch another torch);
#   3. the project itself, editable, with the test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
DEEPSPEED_VERSION=${DEEPSPEED_VERSION:-0.19.8}

# redis-server for the multi-worker dedup test (datasketch's Redis storage). Optional: the test skips
# with a reason where it cannot be installed (not root, no apt).
if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
    || echo "setup_env: could not install redis-server; the Redis dedup test will be skipped" >&2
fi

if [ -f "$VENV/.complete" ] && [ "$(cat "$VENV/.complete")" = "$(sha256sum pyproject.toml scripts/setup_env.sh | sha256sum)" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
$PIP install -q --upgrade "pip>=24" setuptools wheel
$PIP install -q "torch==${TORCH_VERSION}"
$PIP install -q --no-build-isolation "deepspeed==${DEEPSPEED_VERSION}"
$PIP install -q -e ".[test]"
sha256sum pyproject.toml scripts/setup_env.sh | sha256sum > "$VENV/.complete"
echo "environment ready: $VENV"
