#!/usr/bin/env bash
# The project's main job in one command (see docs/main_job.md):
#   bash scripts/run_main.sh [--config configs/main/default.yaml] [--force STAGE] [key.sub=value ...]
# Makes sure the environment exists (scripts/setup_env.sh is idempotent; runtime dependencies only, no
# test extra, no system packages), then runs the orchestrator.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
exec "$VENV/bin/python" -m megatron_ds_suite.app.main_job "$@"
