#!/usr/bin/env bash
# SGLang's own code for the contract tests (`pytest tests -k sglang_contract`): its request classes,
# SamplingParams, sglang.api.v1 JSON contract, ServerArgs' parser and MultiprocessingSerializer,
# checked against megarl's embedded server, client, bridge payloads and launch command lines.
#
# Installed --no-deps into a folder of its own, <venv>/sglang-contract, that only the contract
# tests put on sys.path (tests/rollout/sglang_upstream.py), never into site-packages:
# - sglang's declared requirements would replace torch and transformers and pull CUDA kernels;
# - an importable sglang changes other packages: sglang-router's launcher imports
#   sglang.srt.tracing when sglang is importable, and sglang's import patches transformers for its
#   5.x releases, which fails on the transformers megarl runs, so the router would not start.
# Only these pure-Python (or small, self-contained) modules are needed on its import path.
# Idempotent: a stamp of the pins skips a second install; a changed pin reinstalls the folder.
#   usage: bash scripts/install_sglang.sh [python]     (default .venv/bin/python)
# A newer SGLang: change SGLANG_VERSION (and the Dockerfile's SGLANG_IMAGE), run this, then
# `pytest tests -k sglang_contract` names every field, route or flag that moved.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=${1:-.venv/bin/python}
SGLANG_VERSION=0.5.23
target=$("$VPY" -c "import sys; print(sys.prefix)")/sglang-contract
# pre-downloaded wheels (the sglang wheel is ~40 MB) are taken from MEGARL_WHEEL_DIR when it is set
links=()
[ -n "${MEGARL_WHEEL_DIR:-}" ] && [ -d "$MEGARL_WHEEL_DIR" ] && links=(--find-links "$MEGARL_WHEEL_DIR")
pins=(
  "sglang==${SGLANG_VERSION}"
  pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0
  # sglang/utils.py imports IPython.display at module level; IPython's own import chain:
  ipython==9.18.1 ipython-pygments-lexers==1.1.1 traitlets==5.16.1 jedi==0.20.1 parso==0.8.7
  matplotlib-inline==0.2.2 pexpect==4.9.0 ptyprocess==0.7.0 prompt-toolkit==3.0.53 wcwidth==0.9.4
  stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure-eval==0.2.4
)
stamp="$target/.pins"
want="${pins[*]}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
rm -rf "$target"
# MEGARL_PIP_LOCK: a lock file that serialises this install with others into the same venv
run=("$VPY" -m pip install -q --disable-pip-version-check --no-deps "${links[@]}" --target "$target" "${pins[@]}")
if [ -n "${MEGARL_PIP_LOCK:-}" ] && command -v flock >/dev/null; then
  flock "$MEGARL_PIP_LOCK" "${run[@]}"
else
  "${run[@]}"
fi
echo "$want" > "$stamp"
