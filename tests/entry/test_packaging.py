"""megarl as a package: the wheel declares its dependencies and carries the shipped configs, and an
installed megarl finds a config by name from any directory (as a clone does)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "megarl", "checkpoint_convert", "configs")
CORE = {"torch", "megatron-core", "mbridge", "ray", "transformers", "safetensors", "pyyaml"}


def _requirement_name(text: str) -> str:
    for stop in "<>=!~;[ ":
        text = text.split(stop)[0]
    return text.strip().lower()


def _show_config(name: str, cwd: Path, pythonpath: str, command: list[str] | None = None) -> str:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    argv = command or [sys.executable, "-m", "megarl.cli"]
    out = subprocess.run([*argv, "show-config", name], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def expected_quickstart() -> str:
    """`megarl show-config configs/quickstart.yaml` as it prints in the clone."""
    return _show_config("configs/quickstart.yaml", ROOT, str(ROOT))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (the build writes build/ and *.egg-info there)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(src), "-w", str(dist)]
    # the backend this Python has, when it can build wheels (setuptools >= 70.1); else pip fetches one
    major, minor = (int(x) for x in version("setuptools").split(".")[:2])
    if (major, minor) >= (70, 1):
        cmd.insert(4, "--no-build-isolation")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (built,) = dist.glob("megarl-*.whl")
    return built


def test_the_wheel_declares_the_dependencies_and_carries_the_configs(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(z.read(meta_name).decode())
        entry_points = z.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
        shipped = z.read("megarl/configs/quickstart.yaml")
    requires = meta.get_all("Requires-Dist")
    core = {_requirement_name(r) for r in requires if "extra ==" not in r}
    assert CORE <= core, f"missing from Requires-Dist: {CORE - core}"
    assert {"gpu", "rewards", "bench", "test", "dev", "wandb", "mlflow"} <= set(meta.get_all("Provides-Extra"))
    assert any(r.startswith("torch") and "<2.14" in r for r in requires)  # a range, not the CUDA-or-CPU pin
    assert meta["Requires-Python"] == ">=3.11"
    assert "megarl = megarl.cli:entry" in entry_points
    assert shipped == (ROOT / "configs" / "quickstart.yaml").read_bytes()
    for path in ROOT.joinpath("configs").rglob("*"):
        if path.is_file():
            assert f"megarl/configs/{path.relative_to(ROOT / 'configs')}" in names, path
    assert "checkpoint_convert/__main__.py" in names and "megarl/config/shipped.py" in names
    assert not any(n.startswith(("configs/", "tests/")) for n in names)  # nothing outside the packages


@pytest.mark.slow  # installs the wheel and starts megarl three times: ~8 s on an idle 2-core machine, more when shared
def test_an_installed_wheel_finds_configs_by_name_from_anywhere(wheel, tmp_path, expected_quickstart):
    site = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # only the installed megarl on the path: the dependencies come from this venv's site-packages
    where = subprocess.run(
        [sys.executable, "-c", "import megarl; print(megarl.__file__)"],
        cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.strip() == str(site / "megarl" / "__init__.py"), where.stderr
    assert _show_config("quickstart", elsewhere, str(site), [str(site / "bin" / "megarl")]) == expected_quickstart
    sft = _show_config("sft-quickstart", elsewhere, str(site))
    assert f"train_files: {site / 'megarl' / 'configs' / 'data' / 'sft-arith-tool-train.jsonl'}\n" in sft


def test_a_clone_finds_configs_by_name_from_anywhere(tmp_path, expected_quickstart):
    assert _show_config("quickstart", tmp_path, str(ROOT)) == expected_quickstart


def test_sft_by_name_from_another_directory_reads_the_shipped_chats(tmp_path, monkeypatch):
    """What `megarl sft sft-quickstart` does before its ranks start: every chat row read and masked."""
    from megarl.cli import _preset_model_config
    from megarl.config import load_config
    from megarl.config.validate_sft import validate_sft
    from megarl.trainer.sft_run import prepare_sft_data

    monkeypatch.chdir(tmp_path)
    cfg = load_config("sft-quickstart")
    data = prepare_sft_data(validate_sft(cfg, _preset_model_config(cfg)))
    assert data.steps_per_epoch == 4 and data.total_steps == 40  # 32 conversations, batch 8, 10 epochs
    assert list(tmp_path.iterdir()) == []
