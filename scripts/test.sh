#!/usr/bin/env bash
# The README's test command: installs everything on a fresh machine, lints, then runs the suite.
#   bash scripts/test.sh [--fast] [pytest args]
# --fast runs the unit tier alone (tests/unit: no process started, a few minutes on 2 cores); without it, all
# three tiers run (tests/unit, tests/parallel: gloo ranks and child processes, tests/e2e: commands end to end).
# The test extra (pytest, ruff, the interop/eval/tracking/Ray extras) is installed here, never by the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
TIER=()
if [[ "${1:-}" == "--fast" ]]; then
    TIER=(tests/unit)
    shift
fi
bash scripts/setup_env.sh --extras test
VENV=${VENV:-.venv}
# lint first: the rules in pyproject.toml's [tool.ruff] (a failure fails CI)
"$VENV/bin/python" -m ruff check --quiet . || { echo "test.sh: ruff found problems (see above); fix them or run 'ruff check --fix .'" >&2; exit 1; }
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec "$VENV/bin/python" -m pytest -q -ra "${TIER[@]}" "$@"
