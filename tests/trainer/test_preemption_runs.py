"""A run stopped by a signal loses nothing: real `megarl train` runs (sync and fully_async)
SIGTERMed mid-run finish the step, save, exit 0 saying where, and resume from that checkpoint
(trainer/preemption.py; the handler's rules: test_preemption.py)."""

from __future__ import annotations

import json
import re
import signal
import uuid

from tests._procs import SMALL_RUN, _assert_nothing_left, _start, _tree, _wait_for_line

_STOPPED = re.compile(r"^megarl: stopped by SIGTERM after step (\d+)/1000; checkpoint (\S+); continue with")


def _sigterm_then_resume(tmp_path, config: str, run: str, extra: list[str]) -> tuple[int, str]:
    """Start `config`, SIGTERM the driver after step 2, check the stop; resume it for one more
    step. Returns (the step it stopped after, the resumed run's output)."""
    args = ["train", config, f"trainer.output_dir={tmp_path}", *SMALL_RUN, *extra]
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
    assert checkpoint == str(tmp_path / run / "checkpoints" / f"step_{step:06d}")
    assert json.loads((tmp_path / run / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())
    assert "received: finishing this step" in out and f"step {step + 1}/" not in out
    _assert_nothing_left(run_id, also=tree)

    resumed = _start([*args, f"trainer.total_steps={step + 1}"], uuid.uuid4().hex)
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out[-3000:]
    assert f"resumed from {checkpoint} (step {step}," in out
    steps = [json.loads(x)["step"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, step + 2))  # every step once: none lost, none repeated
    return step, out


def test_sigterm_mid_run_saves_exits_0_and_resumes_sync(tmp_path):
    _sigterm_then_resume(tmp_path, "configs/quickstart.yaml", "quickstart", [])


def test_sigterm_mid_run_saves_exits_0_and_resumes_fully_async(tmp_path):
    _, out = _sigterm_then_resume(tmp_path, "configs/disaggregated.yaml", "disaggregated", ["trainer.mode=fully_async"])
    assert "loop fully_async" in out
