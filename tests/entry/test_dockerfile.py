"""The Dockerfile's pins agree with the CPU environment's (requirements.lock, scripts/setup_env.sh).

The image cannot be built here (no container registry for the base image), so this is what keeps
it honest: every package it installs with a version takes that version from an ARG, and each ARG
equals the pin the test suite runs with.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# ARG -> (package, where the CPU environment pins it)
SHARED = {
    "MEGATRON_CORE_VERSION": ("megatron-core", "scripts/setup_env.sh"),
    "MBRIDGE_VERSION": ("mbridge", "scripts/setup_env.sh"),
    "TRANSFORMERS_VERSION": ("transformers", "requirements.lock"),
    "RAY_VERSION": ("ray", "requirements.lock"),
    "SGLANG_ROUTER_VERSION": ("sglang-router", "requirements.lock"),
    "SAFETENSORS_VERSION": ("safetensors", "requirements.lock"),
    "MATH_VERIFY_VERSION": ("math-verify", "requirements.lock"),
    "REASONING_GYM_VERSION": ("reasoning_gym", "requirements.lock"),
}
GPU_ONLY = {"TRANSFORMER_ENGINE_VERSION": "transformer_engine[pytorch]"}  # no CPU counterpart


def dockerfile_args() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text()
    return {m[1]: m[2].strip('"') for m in re.finditer(r"^ARG (\w+)=(\S+)", text, re.M)}


def cpu_pin(package: str, source: str) -> str:
    text = (ROOT / source).read_text()
    pins = re.findall(rf"(?<![\w-]){re.escape(package)}==([\w.]+)", text, re.I)
    assert len(set(pins)) == 1, f"{source} pins {package} {len(set(pins))} ways: {pins}"
    return pins[0]


def test_dockerfile_pins_equal_the_cpu_environment():
    args = dockerfile_args()
    for arg, (package, source) in SHARED.items():
        assert arg in args, f"Dockerfile has no ARG {arg}"
        assert args[arg] == cpu_pin(package, source), (
            f"Dockerfile {arg}={args[arg]} but {source} pins {package}=={cpu_pin(package, source)}"
        )


def test_every_versioned_install_takes_its_version_from_a_checked_arg():
    text = (ROOT / "Dockerfile").read_text()
    specs = re.findall(r'"([\w\-\[\]]+)==([^"]+)"', text)
    assert len(specs) == len(SHARED) + len(GPU_ONLY)  # ray as ray[default]
    known = {p for p, _ in SHARED.values()} | set(GPU_ONLY.values()) | {"ray[default]"}
    for package, version in specs:
        assert package in known, f"Dockerfile installs {package} with a version no test checks"
        assert re.fullmatch(r"\$\{\w+_VERSION\}", version), f"{package}=={version}: use an ARG"


def test_base_image_and_apex_are_pinned():
    args = dockerfile_args()
    assert re.fullmatch(r"lmsysorg/sglang:v\d+\.\d+\.\d+(\.post\d+)?-cu\d+", args["SGLANG_IMAGE"])
    assert re.fullmatch(r"[0-9a-f]{40}", args["APEX_COMMIT"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TRANSFORMER_ENGINE_VERSION"])
    text = (ROOT / "Dockerfile").read_text()
    assert "FROM ${SGLANG_IMAGE}" in text and "APEX_CUDA_EXT=1" in text


def test_the_image_runs_the_sglang_release_the_contract_tests_pin():
    """The base image's sglang is the release `pytest -k sglang_contract` checks megarl against
    (scripts/install_sglang.sh), and megarl starts SGLang under the image's own interpreter, not the
    virtual environment megarl runs in (megarl/rollout/fleet/sglang_launch.py: sglang_python)."""
    image = re.fullmatch(r"lmsysorg/sglang:v([\d.]+(?:\.post\d+)?)-cu\d+", dockerfile_args()["SGLANG_IMAGE"])
    pinned = re.search(r"^SGLANG_VERSION=(\S+)$", (ROOT / "scripts/install_sglang.sh").read_text(), re.M)
    assert image and pinned and image[1] == pinned[1], (image, pinned)
    text = (ROOT / "Dockerfile").read_text()
    assert "MEGARL_SGLANG_PYTHON=/usr/local/bin/sglang-python" in text
    assert "> /usr/local/bin/sglang-python" in text and "venv --system-site-packages /opt/megarl-venv" in text
