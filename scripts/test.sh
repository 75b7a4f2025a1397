#!/usr/bin/env bash
# The README's test command: installs everything on a fresh machine, lints, then runs the suite.
#   bash scripts/test.sh [pytest args]
# The test extra (pytest, ruff, the interop/eval/tracking/Ray extras) is installed here, never by the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --extras test
VENV=${VENV:-.venv}
# lint first: the rules in pyproject.toml's [tool.ruff] (a failure fails CI)
"$VENV/bin/python" -m ruff check --quiet . || { echo "test.sh: ruff found problems (see above); fix them or run 'ruff check --fix .'" >&2; exit 1; }
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec "$VENV/bin/python" -m pytest -q -ra "$@"
