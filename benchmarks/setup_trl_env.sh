#!/usr/bin/env bash
# Builds .venv-trl in the repo: the benchmark-only venv of Hugging Face TRL that
# benchmarks/bench_vs_trl.py runs its peer in (benchmarks/_trl_grpo.py). megarl's own venv, its
# tests and requirements.lock never need it. Idempotent: a second run only checks a stamp.
#   bash benchmarks/setup_trl_env.sh          (PYTHON=/path/to/python3.11 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=.venv-trl
TORCH=torch==2.13.0  # megarl's pin: both sides run the same torch
TRL=trl==1.16.0      # pulls transformers 5.x, accelerate, datasets (megarl's .venv stays on 4.57)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python
stamp=$VENV/.megarl-trl-deps
want=$(sha256sum benchmarks/setup_trl_env.sh | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pipi() {
  local out
  if ! out=$("$VPY" -m pip install -q --disable-pip-version-check "$@" 2>&1); then
    echo "$out" >&2; echo "setup_trl_env: pip install $* failed" >&2; return 1
  fi
}
# torch first and exactly, as scripts/setup_env.sh does: trl would otherwise pull the newest
# torch and its CUDA packages.
pipi "$TORCH"
pipi "$TRL" "$TORCH"
if "$VPY" -m pip list 2>/dev/null | grep -qi nvidia; then
  echo "setup_trl_env: CUDA packages were pulled in; refusing to continue" >&2; exit 1
fi
"$VPY" -c "import torch, trl, transformers, accelerate, datasets
assert torch.__version__.split('+')[0] == '${TORCH#torch==}', torch.__version__
assert trl.__version__ == '${TRL#trl==}', trl.__version__" \
  || { echo "setup_trl_env: import/version check of $VENV failed" >&2; exit 1; }
echo "$want" > "$stamp"
