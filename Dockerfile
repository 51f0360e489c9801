# megarl for NVIDIA GPU clusters (H100 / H200). Not built in this project's CI: the build machine
# has no access to a container registry for the base image (docs/clusters.md, "Docker").
#   docker build -t megarl:latest .
#   docker run --gpus all --ipc=host --network=host -v /ckpt:/ckpt megarl:latest \
#       megarl show-config configs/qwen3-30b-a3b.yaml
#
# Pins: every version below is an ARG, and tests/entry/test_dockerfile.py checks each against
# requirements.lock / scripts/setup_env.sh (the CPU environment the test suite runs in), so the
# two cannot drift. Change a pin in both places at once.

# SGLang's release image: CUDA 13, PyTorch, FlashInfer and sglang itself, built and tested
# together by the SGLang project. Its sglang release is the one the contract tests pin
# (scripts/install_sglang.sh; tests/entry/test_dockerfile.py holds the two equal): a release is
# checked by setting it in both and running `pytest -k sglang_contract`. Pinned by tag; pin by
# digest (@sha256:...) once pulled.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23-cu130
FROM ${SGLANG_IMAGE}

ARG MEGATRON_CORE_VERSION=0.19.2
ARG MBRIDGE_VERSION=0.15.1
ARG TRANSFORMERS_VERSION=4.57.6
ARG RAY_VERSION=2.60.0
ARG SGLANG_ROUTER_VERSION=0.3.2
ARG SAFETENSORS_VERSION=0.8.0
ARG MATH_VERIFY_VERSION=0.9.0
ARG REASONING_GYM_VERSION=0.1.25
ARG TRANSFORMER_ENGINE_VERSION=2.8.0
# NVIDIA/apex has no releases on PyPI; a commit of its main branch, built from source below.
ARG APEX_COMMIT=705cba91fc26413d484f5ce2983427d840199a97
# Hopper only (H100 / H200): one architecture keeps the TransformerEngine and apex builds to
# minutes instead of an hour. Add "8.0" for A100.
ARG TORCH_CUDA_ARCH_LIST="9.0"
ARG MAX_JOBS=16

ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    MAX_JOBS=${MAX_JOBS} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# Two Python environments in one image. SGLang keeps the image's own: sglang with the
# transformers 5 release it requires (its `import sglang` fails under an older one). megarl runs
# in a virtual environment on top of it (--system-site-packages: the image's torch, CUDA libraries
# and kernels, so TransformerEngine and apex build against the very torch SGLang runs) holding the
# transformers mbridge loads. megarl starts SGLang's servers and sglang-router under the image's
# interpreter, MEGARL_SGLANG_PYTHON (megarl/rollout/fleet/sglang_launch.py), so each side imports
# its own transformers; colocated weight handles pass between the two on the same torch.
RUN printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /usr/local/bin/sglang-python \
 && chmod +x /usr/local/bin/sglang-python \
 && sglang-python -m pip install "sglang-router==${SGLANG_ROUTER_VERSION}" \
 && sglang-python -m venv --system-site-packages /opt/megarl-venv
ENV MEGARL_SGLANG_PYTHON=/usr/local/bin/sglang-python \
    PATH=/opt/megarl-venv/bin:${PATH}

# TransformerEngine: Megatron's fused attention, fused layer norms and FP8 GEMMs on GPU. Built
# against the image's torch (--no-build-isolation; a build-isolated install would fetch a
# different torch and produce a library that fails to load). Its own layer, so changing a pure-
# Python pin below does not rebuild it.
RUN pip install --no-build-isolation "transformer_engine[pytorch]==${TRANSFORMER_ENGINE_VERSION}"

# NVIDIA apex from source with its C++ and CUDA extensions (APEX_CPP_EXT / APEX_CUDA_EXT; a plain
# `pip install apex` gets an unrelated PyPI package, and without the extensions Megatron falls
# back to slow fused-Adam and layer-norm paths). --no-build-isolation for the same reason as TE.
RUN git clone https://github.com/NVIDIA/apex /tmp/apex \
 && git -C /tmp/apex checkout ${APEX_COMMIT} \
 && cd /tmp/apex && APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install -v --no-build-isolation . \
 && rm -rf /tmp/apex

# Megatron-core and mbridge without their dependency lists: megatron-core 0.19.2 declares
# Requires-Python >= 3.12 but ships wheels that work on the image's Python, and both would
# otherwise be allowed to replace the image's torch (scripts/setup_env.sh installs them the same
# way).
RUN pip install --no-deps --ignore-requires-python "megatron-core==${MEGATRON_CORE_VERSION}" \
 && pip install --no-deps "mbridge==${MBRIDGE_VERSION}"

# What megarl needs beyond the image, in its virtual environment: Ray (the controller and worker
# groups) and the transformers / safetensors versions the test suite runs with (mbridge's name
# mappings and the HF <-> Megatron round trips are tested against them). sglang-router (one URL in
# front of many engines) is in the image's environment above, where it runs.
RUN pip install "ray[default]==${RAY_VERSION}" \
    "transformers==${TRANSFORMERS_VERSION}" "safetensors==${SAFETENSORS_VERSION}"

# The rule rewards' verifiers: math-verify (math answers, megarl/reward/math.py) and reasoning-gym
# (procedural tasks with their own scorers, data.task=rg:<name>).
RUN pip install "math-verify==${MATH_VERIFY_VERSION}" "reasoning_gym==${REASONING_GYM_VERSION}"

# megarl itself last: the layer that changes most often. --no-deps: every dependency is pinned
# above, and pyproject.toml's ranges must not let pip replace the image's torch.
WORKDIR /opt/megarl
COPY . /opt/megarl
RUN pip install --no-deps -e /opt/megarl

# Fail the build, not the first job, when a layer above broke an import: each environment imports
# its own side.
RUN sglang-python -c "import sglang, sglang_router, torch, transformers; \
print('sglang', sglang.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)" \
 && python -c "import torch, transformer_engine, apex, megatron.core, mbridge, ray, transformers, megarl, math_verify, reasoning_gym; \
print('megarl: transformers', transformers.__version__, 'torch', torch.__version__)"

CMD ["megarl", "--help"]
