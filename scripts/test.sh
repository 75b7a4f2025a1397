#!/usr/bin/env bash
# The README's test command: installs everything on a fresh machine, lints, then runs the suite.
#   bash scripts/test.sh [pytest args]
# Test-only system packages are installed here, never by the main job: Debian's redis-server for the
# multi-worker dedup tests (datasketch's Redis storage), as root with apt, tried once per venv; those
# tests skip with a reason where it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --extras test
VENV=${VENV:-.venv}
if ! command -v redis-server >/dev/null 2>&1 && [ ! -f "$VENV/.redis-server-tried" ] \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
    || echo "test.sh: could not install redis-server; the Redis dedup tests will be skipped" >&2
  touch "$VENV/.redis-server-tried"
fi
# lint first: the rules in pyproject.toml's [tool.ruff] (a failure fails CI)
"$VENV/bin/python" -m ruff check --quiet . || { echo "test.sh: ruff found problems (see above); fix them or run 'ruff check --fix .'" >&2; exit 1; }
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec "$VENV/bin/python" -m pytest -q -ra "$@"
