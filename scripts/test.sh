#!/usr/bin/env bash
# The README's test command: installs everything on a fresh machine, then runs the suite.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec .venv/bin/python -m pytest -q -ra "$@"
