"""Nothing lost: checkpoints, bit-exact resume after a driver SIGKILL, the Hugging Face export,
the run-dir lock. The runs are real `megarl train` processes (Ray, Megatron ranks, the server).

The resume check is the README's: train N steps uninterrupted; train again with save_every,
SIGKILL the driver mid-run, resume with trainer.resume=auto (here also: SIGKILL a trainer rank of
the resumed run and resume once more); `megarl compare-runs` finds the two metrics.jsonl
identical step for step in every key but the wall-clock ones (CPU fp32, trainer.deterministic=true).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch

from tests._procs import ROOT, _assert_nothing_left, _marked, _start, _tree, _wait_for_line, assert_runs_identical

STEPS = 6
RUN = [
    "configs/quickstart.yaml",
    f"trainer.total_steps={STEPS}",
    "data.num_train=64",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=64",
    "trainer.val_every=0",
    "trainer.loggers=[console,jsonl]",
    "trainer.deterministic=true",
]


def _read(get):
    """A property of a process that may exit meanwhile (None then)."""
    try:
        return get()
    except psutil.Error:
        return None


def _finish(proc: subprocess.Popen, timeout_s: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run; and the same run SIGKILLed (its driver) after its step-2 checkpoint,
    resumed, losing a trainer rank (SIGKILL) after its step-4 checkpoint, and resumed again."""
    root = tmp_path_factory.mktemp("durability")
    # the uninterrupted run beside the interrupted ones (each leaves a core idle part of the time)
    background = ThreadPoolExecutor(1)
    whole_run = background.submit(
        lambda: _finish(_start(["train", *RUN, f"trainer.output_dir={root}/whole"], uuid.uuid4().hex))
    )
    cut = ["train", *RUN, f"trainer.output_dir={root}/cut", "trainer.save_every=1"]

    run_id = uuid.uuid4().hex
    proc = _start(cut, run_id)
    before = _wait_for_line(proc, "checkpoints/step_000002", timeout_s=300)
    alive, tree = _marked(run_id), _tree(proc.pid)
    keys = {_read(lambda: p.environ().get("MEGARL_ROLLOUT_API_KEY")) for p in alive} - {None}
    argv = [_read(lambda: " ".join(p.cmdline())) or "" for p in alive]
    os.kill(proc.pid, signal.SIGKILL)  # the driver only: no handler, no cleanup of its own
    proc.wait()
    _assert_nothing_left(run_id, also=tree)  # its Ray cluster, ranks and server follow it

    run_id = uuid.uuid4().hex
    proc = _start(cut, run_id)
    resumed = _wait_for_line(proc, "checkpoints/step_000004", timeout_s=300)
    [rank1] = [
        p
        for p in _marked(run_id)
        if _read(lambda: p.environ().get("MEGARL_WORKER")) == "actor/1" and p.name().startswith("ray::")
    ]
    tree = _tree(proc.pid)
    os.kill(rank1.pid, signal.SIGKILL)
    killed = time.monotonic()
    out, _ = proc.communicate(timeout=60)  # the required bound: the run stops within 60 s
    rank_stop = {
        "returncode": proc.returncode,
        "s": time.monotonic() - killed,
        "pid": rank1.pid,
        "out": resumed + out,
        "last": [x for x in out.splitlines() if x.strip()][-1],
    }
    _assert_nothing_left(run_id, also=tree)

    again = _finish(_start(cut, uuid.uuid4().hex))
    whole = whole_run.result()
    background.shutdown()
    return {
        "whole": root / "whole" / "quickstart",
        "cut": root / "cut" / "quickstart",
        "whole_out": whole,
        "before_kill": before,
        "resumed_out": resumed,
        "rank_stop": rank_stop,
        "again_out": again,
        "keys": keys,
        "argv": argv,
    }


def test_resumed_run_equals_the_uninterrupted_run_step_for_step(runs):
    assert f"step {STEPS}/{STEPS}" not in runs["before_kill"]  # killed mid-run
    assert "resumed from" in runs["resumed_out"] and "resumed from" in runs["again_out"]
    lines = (runs["cut"] / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, STEPS + 1))  # no step twice
    assert_runs_identical(runs["whole"], runs["cut"], STEPS)
    # the comparison is not vacuous: training moved the numbers it compares
    records = [json.loads(x) for x in lines]
    assert len({r["actor/pg_loss"] for r in records}) > 1 and records[0]["bridge/bytes"] > 0


def test_a_dead_rank_stops_the_run_with_one_line_naming_it_and_the_checkpoint(runs):
    stop = runs["rank_stop"]
    assert stop["returncode"] == 1, stop["out"][-3000:]
    assert f"step {STEPS}/{STEPS}" not in stop["out"]  # stopped mid-run
    line = stop["last"]
    assert line.startswith(f"megarl: actor rank 1 (pid {stop['pid']}, node "), stop["out"][-3000:]
    assert "died during" in line and "killed" in line, line
    assert f"last checkpoint {runs['cut']}/checkpoints/step_0000" in line and "trainer.resume=auto" in line
    assert "train.log" in line and "Traceback" not in stop["out"]
    print(f"rank SIGKILL -> run stopped in {stop['s']:.1f} s")


def test_the_api_key_is_in_no_command_line_and_no_file_of_the_run(runs):
    [key] = runs["keys"]  # the run's one key, read from its server's environment
    assert len(key) >= 32 and len(runs["argv"]) > 3
    assert not [a for a in runs["argv"] if key in a]
    files = [f for f in runs["cut"].rglob("*") if f.is_file()]
    assert any(f.name == "config.yaml" for f in files) and any(f.suffix == ".log" for f in files)
    assert not [f for f in files if key.encode() in f.read_bytes()]


def test_checkpoints_are_complete_pruned_and_marked_latest(runs):
    from megarl.trainer import checkpoints

    found = checkpoints.complete_checkpoints(runs["cut"])
    assert [s for s, _ in found] == [STEPS - 2, STEPS - 1, STEPS]  # trainer.max_checkpoints=3
    assert (runs["cut"] / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:06d}"
    state = checkpoints.read_run_checkpoint(found[-1][1])
    assert state["step"] == STEPS and state["weight_version"] == STEPS
    assert not list((runs["cut"] / "checkpoints").glob("*.partial"))


def test_export_loads_in_transformers_with_the_trainers_log_probs(runs):
    assert_export_matches_checkpoint(runs["cut"] / "hf", runs["cut"] / "checkpoints" / f"step_{STEPS:06d}")


def test_megarl_export_of_a_checkpoint_equals_the_end_of_run_export(runs, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "megarl.cli",
            "export",
            str(runs["cut"]),
            "--step",
            str(STEPS),
            "--out",
            str(tmp_path / "hf"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    mine, final = _tensors(tmp_path / "hf"), _tensors(runs["cut"] / "hf")
    assert mine.keys() == final.keys()
    assert all(torch.equal(mine[k], final[k]) for k in final)
    missing = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "export", str(runs["cut"]), "--step", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "no complete checkpoint of step 1" in missing.stderr


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_export_matches_checkpoint(hf_dir: Path, ckpt: Path) -> None:
    """The exported folder, loaded by transformers (float64), gives the log-probs the trainer's
    Megatron engine gives with the checkpoint's weights (fp32, one rank): atol 1e-5, the fp32
    round-off of the two implementations (tests/engine/test_megatron_engine.py uses the same bound)."""
    from tests._dist import run_ranks
    from tests.engine.test_megatron_engine import hf_reference

    state = json.loads((ckpt / "trainer_state.json").read_text())
    [trainer] = run_ranks(_checkpoint_log_probs, 1, state["model_path"], str(ckpt / "actor"))
    torch.testing.assert_close(hf_reference(hf_dir), trainer.double(), atol=1e-5, rtol=0)
    initial = hf_reference(state["model_path"])  # the policy moved: the check can tell them apart
    assert (initial - trainer.double()).abs().max() > 1e-4


def _checkpoint_log_probs(rank, model_path, actor_ckpt):
    from megarl.config.schema import ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine
    from tests.engine.test_megatron_engine import make_rows

    engine = MegatronEngine(
        EngineSpec(model_path=model_path, parallel=ParallelConfig(), optim=None, micro_batch_size=4)
    )
    engine.initialize()
    engine.load_checkpoint(actor_ckpt, load_optimizer=False)  # saved with EP=2 on two ranks
    return engine.compute_log_prob(make_rows())["log_probs"]


# ------------------------------------------------------------------ no process, no file
def test_resume_never_refuses_a_run_dir_with_checkpoints(runs):
    from megarl.trainer.checkpoints import ResumeRefused, resume_point

    with pytest.raises(ResumeRefused, match="trainer.resume=auto"):
        resume_point(runs["cut"], "never")


def test_auto_ignores_an_interrupted_save_and_a_stale_latest(tmp_path):
    from megarl.trainer import checkpoints

    run = tmp_path / "run"
    done = checkpoints.RunCheckpointer(run, keep=3)
    for step in (1, 2):
        partial = done.begin(step)
        (partial / "actor").mkdir()
        done.commit(step, partial, {"weight_version": step}, "x: 1\n")
    (done.begin(3) / "actor").mkdir()  # killed before trainer_state.json: never read
    (run / "checkpoints" / "latest").write_text("step_000001\n")  # killed before `latest` moved on
    path, state = checkpoints.resume_point(run, "auto")
    assert path.name == "step_000002" and state["step"] == 2
    assert checkpoints.resume_point(tmp_path / "fresh", "auto") is None
    with pytest.raises(checkpoints.CheckpointNotFound, match="never finished"):
        checkpoints.read_run_checkpoint(run / "checkpoints" / "step_000003.partial")


def test_a_second_run_on_a_live_run_dir_is_refused_naming_the_first(tmp_path):
    from megarl.trainer.run_lock import RunDirBusy, RunDirLock

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from megarl.trainer.run_lock import RunDirLock\n"
            f"lock = RunDirLock({str(tmp_path)!r}); lock.acquire(); print('held', flush=True); sys.stdin.read()",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid} on"):
            RunDirLock(tmp_path).acquire()
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "megarl.cli",
                "train",
                "configs/quickstart.yaml",
                f"trainer.output_dir={tmp_path.parent}",
                f"trainer.experiment_name={tmp_path.name}",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"is in use by another live run: pid {holder.pid} on" in second.stderr
    finally:
        holder.kill()
        holder.wait()
    with RunDirLock(tmp_path):  # the kernel dropped the dead holder's lock
        pass


def test_resume_from_a_path_that_is_no_checkpoint_fails_the_run_before_it_starts(tmp_path):
    """trainer.resume names a directory without a checkpoint: the run's own check (the first thing
    a run does once it holds its run dir) refuses it, naming the key, the directory and the fix,
    before anything is started or written (the CLI reports ResumeRefused as a config error, exit
    2). Validation leaves trainer.resume to it: config knows no checkpoints."""
    import io

    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.trainer.checkpoints import ResumeRefused
    from megarl.trainer.run import _train_locked

    missing = tmp_path / "nothing"
    cfg = validate(load_config(ROOT / "configs/quickstart.yaml", [f"trainer.resume={missing}"]))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(ResumeRefused, match=f"trainer.resume={missing}: {missing} does not exist; name a complete"):
        _train_locked(cfg, run_dir, io.StringIO())
    assert list(run_dir.iterdir()) == []  # no config.yaml, no metrics: the run never began


def test_resume_with_other_data_settings_is_refused_before_loading_anything(tmp_path):
    from types import SimpleNamespace

    from megarl.config.schema import RunConfig
    from megarl.trainer.checkpoints import ResumeRefused
    from megarl.trainer.loop import Trainer
    from megarl.trainer.metrics import MetricsLogger

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the actor was used ({name}) before the data check")

    actor = Untouchable()
    runtime = SimpleNamespace(
        cfg=RunConfig(),
        run_dir=tmp_path,
        train_data=[0] * 1024,
        critic=None,
        prm=None,
        actor=SimpleNamespace(mesh=[SimpleNamespace(dp_size=1)]),
        fleet=SimpleNamespace(on_restart=None),
    )
    trainer = Trainer(runtime, MetricsLogger(None, 1))
    runtime.actor = actor
    state = {"step": 3, "weight_version": 3, "data": {**trainer._data_identity(), "train_batch_size": 32}}
    with pytest.raises(ResumeRefused, match="train_batch_size"):
        trainer.restore(tmp_path, state)
