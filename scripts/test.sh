#!/usr/bin/env bash
# README command 2 (= what .ci/run runs): set up .venv (idempotent) and run the whole test suite.
#   bash scripts/test.sh            the whole suite (the 20 slowest tests listed at the end)
#   bash scripts/test.sh --quick    the quick tier: everything not marked slow (tests/conftest.py)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if [ "${1:-}" = "--quick" ]; then
  shift
  exec .venv/bin/python -m pytest -q -m "not slow" --durations=10 tests "$@"
fi
exec .venv/bin/python -m pytest -q --durations=20 tests "$@"  # the 20 slowest, for the suite's time budget
