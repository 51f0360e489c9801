#!/usr/bin/env bash
# README command 2 (= .ci/run): set up .venv (idempotent) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q --durations=20 tests "$@"  # the 20 slowest, for the suite's time budget
