"""Which torch scripts/setup_env.sh installs on the machine it runs on: the plan, from three probes.

    python3 scripts/setup_plan.py --torch torch==2.13.0 --python .venv/bin/python
    python3 scripts/setup_plan.py --torch torch==2.13.0 --gpu no --default-torch cuda --cpu-index unreachable

Standard library only: it runs with the system Python, before anything is installed. Prints shell
assignments that setup_env.sh evaluates (TORCH_SPEC, TORCH_INDEX_URL, REFUSE_NVIDIA, PLAN_MESSAGE);
exits 1 with one line on stderr when no acceptable torch can be had, before anything is downloaded.

- No NVIDIA GPU: a CPU build of torch, never a CUDA one (whose nvidia-* packages are gigabytes that
  a CPU cannot use). Taken from the configured index when it already serves one (a local wheel or
  a CPU mirror: the environment is then exactly what the pins say), else from PyTorch's CPU index.
  Any nvidia-* package that still appears fails the set-up.
- An NVIDIA GPU: the torch the configured index serves (the CUDA build on PyPI). SGLang and
  TransformerEngine are CUDA builds against one torch: the Dockerfile builds them.

Each probe can be fixed by an argument (yes/no, cpu/cuda/unknown, reachable/unreachable), which is
how the decision is tested; `auto` (the default) probes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
DOCKER_HINT = "SGLang and TransformerEngine are not installed here: build the Dockerfile (docs/clusters.md#docker)"


@dataclass(frozen=True)
class Plan:
    torch_spec: str
    index_url: str  # "" = pip's configured index
    refuse_nvidia: bool  # fail the set-up when an nvidia-* package was installed
    message: str

    def shell(self) -> str:
        values = {
            "TORCH_SPEC": self.torch_spec,
            "TORCH_INDEX_URL": self.index_url,
            "REFUSE_NVIDIA": "1" if self.refuse_nvidia else "0",
            "PLAN_MESSAGE": self.message,
        }
        return "".join(f"{k}={shlex.quote(v)}\n" for k, v in values.items())


class NoCpuTorch(RuntimeError):
    """No GPU, the configured index offers only the CUDA build, and the CPU index is out of reach."""


def decide(torch_spec: str, gpu: bool, default_torch: str, cpu_index_reachable: bool) -> Plan:
    """default_torch: what the configured index installs for torch_spec ("cpu", "cuda", "unknown")."""
    if gpu:
        if default_torch == "cpu":
            return Plan(
                torch_spec,
                "",
                False,
                f"NVIDIA GPU, but the configured index serves a CPU build of {torch_spec}: torch will not use "
                f"the GPU (for CUDA torch, PIP_INDEX_URL=https://download.pytorch.org/whl/cuXYZ); {DOCKER_HINT}",
            )
        return Plan(
            torch_spec,
            "",
            False,
            f"NVIDIA GPU: the CUDA build of {torch_spec} from the configured index (about 3 GB with its "
            f"nvidia-* packages, the first time); {DOCKER_HINT}",
        )
    if default_torch == "cpu":
        return Plan(torch_spec, "", True, f"no NVIDIA GPU: the CPU build of {torch_spec} from the configured index")
    if cpu_index_reachable:
        return Plan(torch_spec, CPU_INDEX, True, f"no NVIDIA GPU: the CPU build of {torch_spec} from {CPU_INDEX}")
    if default_torch == "cuda":
        raise NoCpuTorch(
            f"no NVIDIA GPU, the configured index offers only the CUDA build of {torch_spec} (gigabytes of "
            f"nvidia-* packages) and {CPU_INDEX} cannot be reached: make a CPU wheel of {torch_spec} reachable "
            f"(PIP_INDEX_URL=<a mirror of {CPU_INDEX}>, or the wheel in PIP_FIND_LINKS) and run the set-up again"
        )
    return Plan(
        torch_spec,
        "",
        True,
        f"no NVIDIA GPU: {torch_spec} from the configured index (which build it serves could not be told; "
        "the set-up fails if it brings nvidia-* packages)",
    )


# ------------------------------------------------------------------ probes
def probe_gpu() -> bool:
    if os.path.exists("/dev/nvidia0"):
        return True
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def probe_default_torch(python: str, torch_spec: str) -> str:
    """Which build `pip install torch_spec` would take from the configured index, read from pip's
    resolution report without installing (the wheel's metadata only, where the index serves it)."""
    cmd = [python, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "-q", "--report", "-"]
    try:
        out = subprocess.run([*cmd, torch_spec], capture_output=True, text=True, timeout=300)
        found = json.loads(out.stdout)["install"][0]["metadata"] if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, IndexError):
        return "unknown"
    return "unknown" if found is None else build_of(found)


def build_of(metadata: dict) -> str:
    """ "cpu" or "cuda" from a wheel's metadata (as pip's report gives it)."""
    if "+cpu" in metadata.get("version", ""):
        return "cpu"
    needs = metadata.get("requires_dist") or []
    return "cuda" if any(r.lower().startswith("nvidia-") for r in needs) else "cpu"


def probe_index(url: str = CPU_INDEX) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/torch/", timeout=15) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--torch", required=True, help="the pinned requirement, e.g. torch==2.13.0")
    p.add_argument("--python", default=sys.executable, help="the interpreter whose pip asks the index")
    p.add_argument("--gpu", choices=("auto", "yes", "no"), default="auto")
    p.add_argument("--default-torch", choices=("auto", "cpu", "cuda", "unknown"), default="auto")
    p.add_argument("--cpu-index", choices=("auto", "reachable", "unreachable"), default="auto")
    args = p.parse_args(argv)
    gpu = probe_gpu() if args.gpu == "auto" else args.gpu == "yes"
    default = probe_default_torch(args.python, args.torch) if args.default_torch == "auto" else args.default_torch
    # asked only when the answer matters: a machine with a GPU, or whose index serves CPU torch, never waits on it
    needs_cpu_index = not gpu and default != "cpu"
    reachable = args.cpu_index == "reachable" or (args.cpu_index == "auto" and needs_cpu_index and probe_index())
    try:
        plan = decide(args.torch, gpu, default, reachable)
    except NoCpuTorch as err:
        print(f"setup_env: {err}", file=sys.stderr)
        return 1
    print(plan.shell(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
