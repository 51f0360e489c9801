#!/usr/bin/env bash
# Lint, format and import-contract checks (run by .ci/run before the tests; a finding fails CI).
#   bash scripts/lint.sh          check only
#   bash scripts/lint.sh --fix    apply ruff's safe fixes and format, then check
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
BIN=.venv/bin
if [ "${1:-}" = "--fix" ]; then
  "$BIN/ruff" check --fix .
  "$BIN/ruff" format .
fi
"$BIN/ruff" check .
"$BIN/ruff" format --check .
"$BIN/lint-imports" --no-cache
