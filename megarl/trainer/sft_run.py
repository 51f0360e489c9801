"""`megarl sft`: the data read and checked in the driver before anything starts, then the run
(locked run dir, resume point, Ray, the actor's Megatron ranks: no rollout engine), the SFT loop
(sft.py), the export and the summary. The pieces are train's (run.py, runtime.py)."""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

from megarl.config.schema import RunConfig
from megarl.data.build import as_paths
from megarl.data.errors import DatasetError
from megarl.engine.megatron.actor import ActorLossSpec
from megarl.trainer.sft import SFTData, SFTLoop, SFTRuntime


def sft_tokenizer(cfg: RunConfig):
    """The tokenizer of the model the run starts from, without building the model: model.path's,
    the SmolLM2 preset's (converted once, cached), or a tiny preset's (built in code)."""
    from transformers import AutoTokenizer

    from megarl.models import smollm2
    from megarl.models.tiny import TOOLS_PRESET, build_tokenizer

    if cfg.model.path is not None:
        return AutoTokenizer.from_pretrained(cfg.model.path)
    if cfg.model.preset == smollm2.PRESET:
        return AutoTokenizer.from_pretrained(str(smollm2.materialize()))
    return build_tokenizer(tools=cfg.model.preset == TOOLS_PRESET)


def prepare_sft_data(cfg: RunConfig) -> SFTData:
    """Every train and val row read, checked, rendered and masked; DatasetError (one line naming
    the file, the row and the field, or the tokenizer) before any process starts."""
    from megarl.data.sft import SFTDataset, check_chat_tokenizer

    s = cfg.sft
    tokenizer = sft_tokenizer(cfg)
    check_chat_tokenizer(
        tokenizer, f"model.path={cfg.model.path}" if cfg.model.path else f"model.preset={cfg.model.preset}"
    )
    args = (tokenizer, s.max_length, s.overlong, s.messages_key)
    if s.task is None:
        train = SFTDataset.from_files(as_paths(s.train_files), *args)
    else:
        train = _task_dataset(s, tokenizer, s.num_train, s.seed)
    val = SFTDataset.from_files(as_paths(s.val_files), *args) if s.val_files is not None else None
    if val is None and s.task is not None and s.num_val > 0:
        val = _task_dataset(s, tokenizer, s.num_val, s.seed + 1)
    if len(train) < s.batch_size:
        raise DatasetError(
            f"{train.source} has {len(train)} conversations to train on, fewer than one batch of "
            f"sft.batch_size={s.batch_size}; lower sft.batch_size or add rows"
        )
    per_epoch = len(train) // s.batch_size  # the last partial batch of an epoch is left out
    total = s.total_steps if s.total_steps is not None else (s.epochs or 1) * per_epoch
    return SFTData(train, val, per_epoch, total)


def _task_dataset(s, tokenizer, num: int, seed: int):
    from megarl.data.sft import SFTDataset
    from megarl.data.tasks import generate_chats

    rows = generate_chats(s.task, num, seed)
    return SFTDataset(rows, tokenizer, s.max_length, s.overlong, "messages", source=f"sft.task={s.task} (seed {seed})")


@contextlib.contextmanager
def start_sft_runtime(cfg: RunConfig, cluster=None):
    """Yield an SFTRuntime; on exit stop every process it started (runtime.start_runtime's pieces:
    the model, Ray, the actor pool and ranks, without engines, reference or critic)."""
    from megarl.controller.placement import plan_placement
    from megarl.trainer.runtime import (
        StartupClock,
        cluster_for,
        reserve_pools,
        resolve_model_path,
        run_dir_of,
        worker_groups,
    )

    clock, run_dir, plan = StartupClock(), run_dir_of(cfg), plan_placement(cfg)
    with contextlib.ExitStack() as stack:
        if cluster is None:
            cluster = cluster_for(cfg, plan)
            cluster.start(background=True)
        stack.push(cluster.__exit__)
        model_path = resolve_model_path(cfg, run_dir)
        clock.mark("model")
        pools, resource, record = reserve_pools(plan, run_dir, cluster, stack, clock, names=("actor",))
        sft = ActorLossSpec(objective="sft")
        actor, _, _ = worker_groups(cfg, plan, pools, resource, model_path, stack, clock, loss=sft)
        record(actor.processes)
        yield SFTRuntime(cfg, run_dir, model_path, actor, plan, startup=clock.phases)


def run_sft(cfg: RunConfig, data: SFTData, stream=sys.stdout) -> dict:
    """Run the SFT of `cfg` (validated, validate_sft) on `data` (prepare_sft_data) to completion
    or until a signal stops it at a step boundary; returns the loss-curve summary."""
    from megarl.trainer.run import locked_run

    return locked_run(cfg, stream, lambda *args: _sft_locked(data, *args))


def _sft_locked(data: SFTData, cfg: RunConfig, run_dir: Path, stream, cluster, point, stop) -> dict:
    from megarl.trainer.run import finish_summary, run_logger
    from megarl.trainer.runtime import StartupClock

    logger = run_logger(cfg, run_dir, stream, point, data.total_steps)
    try:
        with start_sft_runtime(cfg, cluster) as runtime:
            stream.write(
                f"megarl: sft run dir {run_dir}; actor mesh {runtime.actor.mesh[0].describe()} "
                f"x{len(runtime.actor.mesh)}; {data.describe()}, {data.total_steps} steps; start-up "
                f"{StartupClock.describe(runtime.startup or {})}\n"
            )
            loop = SFTLoop(runtime, logger, data, resume=point, stop=stop)
            loop.fit()
    except BaseException:
        logger.close(failed=True)  # the trackers mark their run failed
        raise
    logger.close()
    summary = logger.curve_summary("sft/loss", window=min(10, max(1, math.ceil(data.total_steps / 4))))
    summary["data"] = data.describe()
    curve = (
        f"sft loss: first {summary.get('window')} steps mean {summary.get('first_mean', 0):.4f} -> last "
        f"{summary.get('window')} steps mean {summary.get('last_mean', 0):.4f} over {summary.get('steps')} steps"
    )
    return finish_summary(cfg, run_dir, stream, summary, curve, loop.stopped)
