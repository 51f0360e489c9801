"""A run stopped by a signal loses nothing: real `megarl train` runs (sync and fully_async)
SIGTERMed mid-run finish the step, save, exit 0 saying where, and resume from that checkpoint; a
second Ctrl-C stops at once, leaving no process (trainer/preemption.py; the handler's rules:
test_preemption.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import uuid

from tests._procs import (
    SMALL_RUN,
    _assert_nothing_left,
    _marked,
    _start,
    _tree,
    _wait_for_line,
    _wait_until_none_left,
)

_STOPPED = re.compile(r"^megarl: stopped by SIGTERM after step (\d+)/1000; checkpoint (\S+); continue with")


def _sigterm(tmp_path, config: str, run: str, extra: list[str]) -> tuple[list[str], int, str]:
    """Start `config`, SIGTERM the driver after step 2 and check the stop: exit 0, the last line
    naming the checkpoint of the step it stopped after, nothing left. Returns (the run's
    arguments, that step, the checkpoint)."""
    args = ["train", config, f"trainer.output_dir={tmp_path}", *SMALL_RUN, "trainer.save_every=0", *extra]
    run_id = uuid.uuid4().hex
    proc = _start(args, run_id)
    _wait_for_line(proc, "step 2/", timeout_s=240)
    tree = _tree(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    last = [x for x in out.splitlines() if x.strip()][-1]
    match = _STOPPED.match(last)
    assert match, out[-3000:]
    step, checkpoint = int(match[1]), match[2]
    # saved because of the signal (save_every 0 saves nothing else)
    assert checkpoint == str(tmp_path / run / "checkpoints" / f"step_{step:06d}")
    assert json.loads((tmp_path / run / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())
    assert "received: finishing this step" in out and f"step {step + 1}/" not in out
    _assert_nothing_left(run_id, also=tree)
    return args, step, checkpoint


def _steps(tmp_path, run: str) -> list[int]:
    return [json.loads(x)["step"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_mid_run_saves_exits_0_and_resumes_fully_async_and_survives_a_driver_sigkill(tmp_path):
    args, step, checkpoint = _sigterm(
        tmp_path, "configs/disaggregated.yaml", "disaggregated", ["trainer.mode=fully_async"]
    )
    # resumed, saving every step, then its driver SIGKILLed (an OOM kill, a lost node): nothing of
    # the run is left, and the next run resumes from its last checkpoint (rollouts in flight are
    # regenerated, docs/loops.md); the killed run's steps past that checkpoint are logged again
    run_id = uuid.uuid4().hex
    resumed = _start([*args, "trainer.save_every=1"], run_id)
    out = _wait_for_line(resumed, f"step {step + 2}/", timeout_s=240)
    tree = _tree(resumed.pid)
    os.kill(resumed.pid, signal.SIGKILL)
    resumed.communicate(timeout=30)
    assert f"resumed from {checkpoint} (step {step}," in out and "loop fully_async" in out
    _wait_until_none_left(run_id, within_s=30, also=tree)
    final = _start([*args, "trainer.save_every=1", f"trainer.total_steps={step + 4}"], uuid.uuid4().hex)
    out, _ = final.communicate(timeout=300)
    assert final.returncode == 0, out[-3000:]
    last = max(int(p.name.split("_")[1]) for p in (tmp_path / "disaggregated" / "checkpoints").glob("step_*"))
    assert last == step + 4 and re.search(rf"resumed from \S+step_0*({step + 1}|{step + 2}) ", out), out[-3000:]
    assert _steps(tmp_path, "disaggregated") == list(range(1, step + 5))  # every step once: none lost or repeated


def test_sigterm_saves_and_resumes_then_ctrl_c_twice_stops_at_once_sync(tmp_path):
    """The sync loop stopped by SIGTERM resumes from its checkpoint; that run, interrupted twice
    from a terminal (Ctrl-C goes to the whole process group; Ray's daemons ignore it), stops at
    once without saving (the first Ctrl-C asks for a stop with a checkpoint, the second
    overrides it), exit 130, and every process it started is gone."""
    args, step, checkpoint = _sigterm(tmp_path, "configs/quickstart.yaml", "quickstart", [])
    run_id = uuid.uuid4().hex
    proc = _start(args, run_id, start_new_session=True)
    _wait_for_line(proc, f"resumed from {checkpoint} (step {step},", timeout_s=240)
    _wait_for_line(proc, f"step {step + 1}/", timeout_s=120)
    assert len(_marked(run_id)) > 3  # Ray, the server and Megatron ranks are really up
    tree = _tree(proc.pid)  # also Ray's agents, whose environment the marker cannot be read from
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    _wait_for_line(proc, "SIGINT received: finishing this step", timeout_s=60)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted again while stopping; stopped without saving" in out
    assert "stopped by SIGINT" not in out  # no "saved, continue from it" line
    _assert_nothing_left(run_id, also=tree)
    steps = _steps(tmp_path, "quickstart")
    assert steps[: step + 1] == list(range(1, step + 2))  # the resumed run went on where it stopped
