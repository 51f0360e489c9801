"""Run checkpoints: everything a run needs to continue as if it had never stopped.

    RUN_DIR/checkpoints/
        step_000004/             one complete checkpoint
            actor/               the actor engine's torch_dist checkpoint: model, optimizer and
                                 every rank's RNG (engine/megatron/checkpoint.py)
            critic/              the critic's, when the run has one
            trainer_state.json   step, weight version, data position, metrics position, the
                                 driver's RNG, the model the run started from; "complete": true
            config.yaml          the run's config at the time (for the record)
        latest                   the name of the newest complete checkpoint

A save fills `step_N.partial/`, writes trainer_state.json last (fsynced), renames the directory
to `step_N`, then replaces `latest` (temp file + rename). A crash at any point leaves the previous
checkpoints and `latest` as they were; a `.partial` is never read and the next save removes it.
`auto` resume trusts the directories (the newest `step_N` whose trainer_state.json says complete),
not `latest` alone, so a crash between the rename and the `latest` update loses nothing.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from megarl.engine.megatron.checkpoint import fsync_dir

FORMAT_VERSION = 1
STATE_FILE = "trainer_state.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointNotFound(Exception):
    """A directory that is not a complete run checkpoint (the message says what is wrong)."""


class ResumeRefused(Exception):
    """Starting this run would overwrite or misread another run's checkpoints."""


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:06d}"


def read_run_checkpoint(path: Path) -> dict:
    """trainer_state.json of the complete checkpoint `path`; CheckpointNotFound says why not."""
    path = Path(path)
    if path.name.endswith(".partial"):
        raise CheckpointNotFound(f"{path} is the staging directory of a save that never finished")
    if not path.is_dir():
        raise CheckpointNotFound(f"{path} does not exist")
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointNotFound(f"{path} has no {STATE_FILE}: not a run checkpoint, or its save did not finish")
    try:
        state = json.loads(state_file.read_text())
    except ValueError as err:
        raise CheckpointNotFound(f"{state_file} is not valid JSON ({err})") from None
    if not state.get("complete") or state.get("format") != FORMAT_VERSION:
        raise CheckpointNotFound(f"{state_file}: not a complete format-{FORMAT_VERSION} checkpoint")
    if not (path / "actor").is_dir():
        raise CheckpointNotFound(f"{path} has no actor/ checkpoint")
    return state


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint of the run, oldest first."""
    root = checkpoints_dir(run_dir)
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        match = _STEP_DIR.match(child.name)
        if not match:
            continue
        try:
            read_run_checkpoint(child)
        except CheckpointNotFound:
            continue
        found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def resume_point(run_dir: Path, resume: str) -> tuple[Path, dict] | None:
    """The checkpoint a run with trainer.resume=`resume` continues from, or None (start fresh)."""
    if resume == "never":
        newest = latest_checkpoint(run_dir)
        if newest is not None:
            raise ResumeRefused(
                f"trainer.resume=never, but {run_dir} holds checkpoints of an earlier run (newest "
                f"{newest.name}); continue it with trainer.resume=auto, or start elsewhere with a new "
                f"trainer.experiment_name (or delete {checkpoints_dir(run_dir)})"
            )
        return None
    if resume == "auto":
        path = latest_checkpoint(run_dir)
        return None if path is None else (path, read_run_checkpoint(path))
    try:
        return Path(resume), read_run_checkpoint(Path(resume))
    except CheckpointNotFound as err:
        raise ResumeRefused(
            f"trainer.resume={resume}: {err}; name a complete checkpoint directory "
            "(RUN_DIR/checkpoints/step_NNNNNN), or use trainer.resume=auto or never"
        ) from None


def driver_rng_state() -> dict:
    """The controller's own random generators (a custom reward function may draw from them)."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(words), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }


def set_driver_rng_state(state: dict) -> None:
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


class RunCheckpointer:
    """Saves of one run: `begin` a step's staging dir, fill it, `commit` it; keeps the newest K."""

    def __init__(self, run_dir: Path, keep: int):
        self.run_dir, self.keep = Path(run_dir), keep

    def begin(self, step: int) -> Path:
        """A fresh staging directory for step `step` (what an interrupted save left is removed)."""
        partial = Path(f"{step_dir(self.run_dir, step)}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        return partial

    def commit(self, step: int, partial: Path, state: dict, config_yaml: str) -> Path:
        """Make the staged checkpoint complete and current; returns its final directory."""
        (partial / "config.yaml").write_text(config_yaml)
        _write_atomic(
            partial / STATE_FILE,
            json.dumps({"format": FORMAT_VERSION, "complete": True, "step": step, **state}, indent=1),
        )
        final = step_dir(self.run_dir, step)
        if final.exists():  # a re-save of the same step (a resumed run saving where it started)
            shutil.rmtree(final)
        os.rename(partial, final)
        fsync_dir(final.parent)
        _write_atomic(final.parent / LATEST, final.name + "\n")
        self._prune()
        return final

    def _prune(self) -> None:
        for _, path in complete_checkpoints(self.run_dir)[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)
        for stale in checkpoints_dir(self.run_dir).glob("step_*.partial"):
            shutil.rmtree(stale, ignore_errors=True)  # interrupted saves of earlier attempts


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
