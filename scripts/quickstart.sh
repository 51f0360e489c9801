#!/usr/bin/env bash
# README command 1: set up .venv (idempotent) and run the CPU quickstart: GRPO with a real
# Megatron-core engine on 2 gloo ranks, Ray, and the embedded rollout server.
# Extra arguments are dotted config overrides, e.g. trainer.total_steps=50.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/megarl train configs/quickstart.yaml "$@"
