"""Run `megarl` as a user does and find every process a run started, also orphans.

Every process a run starts inherits the environment, so a unique marker variable finds them all:
Ray's raylet, GCS and workers, the rollout servers, Megatron ranks. Not quite all: Ray's dashboard
and runtime-env agents overwrite their environment with their process title, so `_tree` (the
driver's descendants, recorded while it lives) covers what the marker cannot.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
MARKER = "MEGARL_TEST_RUN_ID"

SMALL_RUN = [
    "trainer.total_steps=1000",
    "data.num_train=64",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=64",
    "trainer.val_every=0",
    "trainer.loggers=[console,jsonl]",
]


def _marked(run_id: str, also: list[psutil.Process] = ()) -> list[psutil.Process]:
    """Live processes with the run's marker, and those of `also` still running (not zombies)."""
    found = {}
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid != os.getpid() and proc.environ().get(MARKER) == run_id:
                found[proc.pid] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    for proc in also:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                found.setdefault(proc.pid, proc)
        except psutil.Error:
            continue
    return list(found.values())


def _tree(pid: int) -> list[psutil.Process]:
    """`pid` and its descendants now (a snapshot: orphans lose their parent link later)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def run_cli(*args) -> subprocess.CompletedProcess:
    """`megarl ARGS` to completion (output captured as text)."""
    return subprocess.run(
        [sys.executable, "-m", "megarl.cli", *map(str, args)], cwd=ROOT, capture_output=True, text=True
    )


def assert_runs_identical(whole, cut, steps: int) -> None:
    """`megarl compare-runs` finds the two run dirs' metrics identical over `steps` steps."""
    out = run_cli("compare-runs", whole, cut)
    assert out.returncode == 0 and f"identical: {steps} steps" in out.stdout, out.stdout + out.stderr


def _start(args: list[str], run_id: str, **kw) -> subprocess.Popen:
    env = {**os.environ, MARKER: run_id, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "megarl.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def _wait_until_none_left(run_id: str, within_s: float, also: list[psutil.Process] = ()) -> float:
    """Seconds until no process of the run is left; raises (killing the rest) after `within_s`."""
    start = time.monotonic()
    deadline = start + within_s
    while time.monotonic() < deadline and _marked(run_id, also):
        time.sleep(0.2)
    left = _marked(run_id, also)
    names = []
    for proc in left:  # clean up before failing, so one failure does not poison later tests
        try:
            names.append((proc.pid, proc.name()))
            proc.kill()
        except psutil.Error:
            pass
    assert not left, f"processes left running {within_s:.0f}s on: {names}"
    return time.monotonic() - start


def _assert_nothing_left(run_id: str, within_s: float = 30.0, also: list[psutil.Process] = ()) -> None:
    _wait_until_none_left(run_id, within_s, also)


def _wait_for_line(proc: subprocess.Popen, text: str, timeout_s: float) -> str:
    seen, deadline = [], time.time() + timeout_s
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    proc.kill()
    raise AssertionError(f"never saw {text!r}; output:\n{''.join(seen)[-3000:]}")


def whole_and_resumed(root: Path, run: list[str], steps: int, cut_extra: tuple[str, ...] = ()) -> str:
    """`megarl train` of `run` for `steps` steps under root/whole, checkpointing at step steps // 2;
    then that run dir as a run stopped right after its mid checkpoint would leave it (copied to
    root/cut, the later checkpoints removed; the metrics past the checkpoint stay, as a killed
    run's would, for the resume to drop) resumed to `steps`. Returns the resumed run's output;
    each run must succeed within 300 s. Two runs, not three: the uninterrupted run is also the
    one that stops."""
    import shutil
    import uuid

    def finish(args: list[str]) -> str:
        out, _ = (proc := _start(["train", *args], uuid.uuid4().hex)).communicate(timeout=300)
        assert proc.returncode == 0, out[-4000:]
        return out

    half = steps // 2
    every = f"trainer.save_every={half}"
    finish([*run, f"trainer.total_steps={steps}", f"trainer.output_dir={root}/whole", every])
    shutil.copytree(root / "whole", root / "cut", symlinks=True)
    [run_dir] = [d for d in (root / "cut").iterdir() if d.is_dir()]
    for end_of_run in ("hf", "lora", "summary.json"):  # what only a finished run writes
        path = run_dir / end_of_run
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    kept = f"step_{half:06d}"
    for ckpt in (run_dir / "checkpoints").iterdir():
        if ckpt.name.startswith("step_") and ckpt.name != kept:
            shutil.rmtree(ckpt)
    (run_dir / "checkpoints" / "latest").write_text(kept)
    return finish([*run, *cut_extra, f"trainer.total_steps={steps}", f"trainer.output_dir={root}/cut", every])
