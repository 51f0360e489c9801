#!/usr/bin/env bash
# SGLang's own code for the contract tests (tests/rollout/**/test_sglang_contract*.py): its request
# classes, SamplingParams, ServerArgs' parser and MultiprocessingSerializer, checked against
# megarl's embedded server and launch command lines. Installed --no-deps: sglang's declared
# requirements would replace torch and transformers and pull CUDA kernels; the contract tests need
# only these pure-Python (or small, self-contained) modules on its import path. Idempotent: pip
# leaves installed pins alone. Another install may share the virtual environment, so pip runs
# under a lock.
#   usage: bash scripts/install_sglang.sh [python]     (default .venv/bin/python)
# A newer SGLang: change SGLANG_VERSION (and the Dockerfile's SGLANG_IMAGE), then
# `pytest tests -k sglang_contract` names every field or flag that moved.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=${1:-.venv/bin/python}
SGLANG_VERSION=0.5.23
# A pre-downloaded wheel is used when present (offline machines); otherwise PyPI.
wheel=$(ls /work/wheels/sglang-${SGLANG_VERSION}-*.whl 2>/dev/null | head -n1 || true)
pins=(
  "${wheel:-sglang==${SGLANG_VERSION}}"
  pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0
  # sglang/utils.py imports IPython.display at module level; IPython's own import chain:
  ipython==9.18.1 ipython-pygments-lexers==1.1.1 traitlets==5.16.1 jedi==0.20.1 parso==0.8.7
  matplotlib-inline==0.2.2 pexpect==4.9.0 ptyprocess==0.7.0 prompt-toolkit==3.0.53 wcwidth==0.9.4
  stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure-eval==0.2.4
)
lock=${MEGARL_PIP_LOCK:-/work/pip.lock}
if [ -d "$(dirname "$lock")" ] && command -v flock >/dev/null; then
  flock "$lock" "$VPY" -m pip install -q --disable-pip-version-check --no-deps "${pins[@]}"
else
  "$VPY" -m pip install -q --disable-pip-version-check --no-deps "${pins[@]}"
fi
"$VPY" -c "import importlib.metadata as m; v = m.version('sglang'); assert v == '${SGLANG_VERSION}', v"
