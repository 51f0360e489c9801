"""`megarl train`: lock the run dir, find where to resume, bring the runtime up, run the loop,
export the policy, summarise, tear down. Everything printed also goes to RUN_DIR/train.log."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from megarl.config.loader import dump
from megarl.config.schema import RunConfig


class Tee:
    """A text stream writing to several (the terminal and the run's log file)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


def log_path_of(run_dir: Path) -> Path:
    return Path(run_dir) / "train.log"


_LOOK_UP = object()  # _train_locked's `point` not given: look it up


def train(cfg: RunConfig, stream=sys.stdout) -> dict:
    """Run `cfg` (already validated) to completion, or until a signal stops it at a step boundary
    (trainer/preemption.py: the summary's "stopped" line then says where it saved); returns the
    reward-curve summary."""
    return locked_run(cfg, stream, _train_locked)


def locked_run(cfg: RunConfig, stream, body) -> dict:
    """body(cfg, run_dir, stream, cluster, point, stop) in the locked run dir (train and
    `megarl sft`): the resume point found (or refused) before Ray starts, Ray starting in the
    background, SIGUSR1 noted from the start, everything printed also in RUN_DIR/train.log."""
    import signal

    from megarl.trainer import checkpoints, status
    from megarl.trainer.preemption import GracefulStop
    from megarl.trainer.run_lock import RunDirLock
    from megarl.trainer.runtime import cluster_for, run_dir_of

    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    stop = GracefulStop(cfg.trainer.stop_grace_s)  # SIGUSR1 from now on; the rest once the loop runs
    with (
        stop.handling(signal.SIGUSR1),
        RunDirLock(run_dir),
        open(log_path_of(run_dir), "a") as log,
        status.shown_on(stream) as terminal,  # on a terminal a status line under the lines (status.py)
    ):
        point = checkpoints.resume_point(run_dir, cfg.trainer.resume)  # refused before Ray starts
        # Ray starts now, in the background, and comes up while this process imports torch,
        # Megatron and transformers and builds the model and the data (~6 s of a quickstart's
        # start-up that used to come after them); start_runtime waits for it, then stops it.
        cluster = cluster_for(cfg)
        cluster.start(background=True)
        with contextlib.closing(cluster):  # closed already when start_runtime took it over
            return body(cfg, run_dir, Tee(terminal, log), cluster, point, stop)


def _train_locked(cfg: RunConfig, run_dir: Path, stream, cluster=None, point=_LOOK_UP, stop=None) -> dict:
    """The run in its locked run dir; `point`: the checkpoint to continue from (resume_point's
    answer; looked up here when not given); `stop`: its signal handling (the Trainer's own when
    None)."""
    from megarl.trainer import checkpoints
    from megarl.trainer.loop import Trainer
    from megarl.trainer.runtime import StartupClock, start_runtime

    if point is _LOOK_UP:
        point = checkpoints.resume_point(run_dir, cfg.trainer.resume)
    logger = run_logger(cfg, run_dir, stream, point, cfg.trainer.total_steps)
    try:
        with start_runtime(cfg, cluster) as runtime:
            critic = (
                f"; critic mesh {runtime.critic.mesh[0].describe()} x{len(runtime.critic.mesh)}"
                if runtime.critic is not None
                else ""
            )
            router = f" behind router {runtime.fleet.router_url}" if runtime.fleet.router_url else ""
            stream.write(
                f"megarl: run dir {run_dir}; {runtime.placement.describe()}; rollout engines "
                f"{runtime.server_urls}{router}; actor mesh {runtime.actor.mesh[0].describe()} "
                f"x{len(runtime.actor.mesh)}{critic}; loop {cfg.trainer.mode}; start-up "
                f"{StartupClock.describe(runtime.startup or {})}\n"
            )
            trainer = Trainer(runtime, logger, resume=point, stop=stop)
            trainer.fit()
    except BaseException:
        logger.close(failed=True)  # the trackers mark their run failed
        raise
    logger.close()
    summary = logger.curve_summary("reward/mean", window=10)
    curve = (
        f"reward curve: first {summary.get('window')} steps mean {summary.get('first_mean', 0):.3f} -> "
        f"last {summary.get('window')} steps mean {summary.get('last_mean', 0):.3f} "
        f"(x{summary.get('ratio', 0):.1f}, max {summary.get('max', 0):.3f}) over {summary.get('steps')} steps"
    )
    return finish_summary(cfg, run_dir, stream, summary, curve, trainer.stopped)


def run_logger(cfg: RunConfig, run_dir: Path, stream, point, total_steps: int):
    """The run's config.yaml written and its MetricsLogger (metrics.jsonl, the console and the
    trackers of trainer.loggers), continuing after the resume point's step."""
    from megarl.trainer.metrics import MetricsLogger
    from megarl.trainer.trackers import make_trackers

    (run_dir / "config.yaml").write_text(dump(cfg))
    resume_step = point[1]["step"] if point else 0
    return MetricsLogger(
        make_trackers(cfg, run_dir, resume_step),
        total_steps,
        cfg.trainer.log_every,
        stream,
        jsonl_path=run_dir / "metrics.jsonl",
        resume_step=resume_step,
        console="console" in cfg.trainer.loggers,
    )


def finish_summary(cfg: RunConfig, run_dir: Path, stream, summary: dict, curve: str, stopped) -> dict:
    """RUN_DIR/summary.json, and the run's last lines: `curve` (when a step ran) and where a
    signal stopped it (`stopped`, preemption.Stopped)."""
    summary["tensorboard_dir"] = str(run_dir / "tensorboard") if "tensorboard" in cfg.trainer.loggers else None
    summary["stopped"] = stopped.line() if stopped else None
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if summary.get("steps"):
        stream.write(curve + "\n")
    if summary["stopped"]:
        stream.write(summary["stopped"] + "\n")
    return summary
