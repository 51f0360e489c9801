"""The SFT loop: every step one batch of conversations through the actor's own update.

    for step in steps:                                   # fit()
        batch = batches.batch_at(step - 1)               # data/sft.py: epoch-shuffled, by step
        batch = balanced over data-parallel ranks        # by tokens, as train's rows are
        actor.update_actor(batch, len(batch))            # one optimizer step; objective "sft":
                                                         #   token-mean NLL of the assistant tokens
        finish_step(step, metrics)                       # val loss, metrics, checkpoint when due

The actor's ranks are train's (MegatronActor, built with ActorLossSpec(objective="sft")), so its
micro-batching, THD packing, every TP / PP / EP / CP layout, the distributed optimizer,
checkpoints and export are train's too. Durability is run_state's: checkpoints every
trainer.save_every steps and at the end, trainer.resume, a signal stops at a step boundary
(preemption.py), the policy exported to RUN_DIR/hf. There is no rollout engine: a step's weights
go nowhere but the next step. sft_run.py makes what the loop runs on (SFTData, SFTRuntime).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.config.schema import RunConfig
from megarl.data.balance import balance_across_ranks
from megarl.data.sft import SFTBatches, SFTDataset, eval_batches
from megarl.engine.megatron.packing import row_lengths
from megarl.trainer import checkpoints, finite, run_state
from megarl.trainer.metrics import MetricsLogger
from megarl.trainer.mfu import StepMfu
from megarl.trainer.preemption import STOP_SIGNALS, GracefulStop, Stopped
from megarl.trainer.step_metrics import average, timer

if TYPE_CHECKING:
    from megarl.controller.placement import PlacementPlan
    from megarl.controller.worker_group import RayWorkerGroup
    from megarl.data.batch import Batch


@dataclass
class SFTData:
    """An SFT run's conversations, tokenized and masked in the driver (data/sft.py)."""

    train: SFTDataset
    val: SFTDataset | None
    steps_per_epoch: int
    total_steps: int

    def describe(self) -> str:
        c = self.train.counts
        cut = f"; {c.truncated} cut to sft.max_length, {c.dropped} of them dropped" if c.truncated else ""
        val = f", {len(self.val)} val" if self.val is not None else ""
        return (
            f"{len(self.train)} train conversations ({self.train.tokens()} tokens{cut}){val}; "
            f"{self.steps_per_epoch} steps per epoch"
        )


@dataclass
class SFTRuntime:
    """What the SFT loop talks to: the actor's ranks (objective sft), started by start_sft_runtime."""

    cfg: RunConfig
    run_dir: Path
    model_path: str
    actor: RayWorkerGroup  # of MegatronActor
    placement: PlacementPlan
    critic: None = None  # run_state's checkpoints look for these
    prm: None = None
    startup: dict[str, float] | None = None


def batch_loss(metrics: dict) -> float:
    """The token-mean loss of a step's whole batch from the data-parallel ranks' averaged metrics
    (step_metrics.average), popping the sums sft_loss reported. Each rank's sums are means over
    its micro-batches, and every rank runs as many, so the ratio of the means is exact."""
    return metrics.pop("sft/nll_sum") / metrics.pop("sft/loss_tokens")


class SFTLoop:
    def __init__(
        self,
        runtime: SFTRuntime,
        logger: MetricsLogger,
        data: SFTData,
        resume: tuple | None = None,
        stop: GracefulStop | None = None,
    ):
        """`resume`: (checkpoint dir, its trainer state) to continue from (checkpoints.resume_point);
        `stop`: the run's signal handling (preemption.py; default: one of its own)."""
        self.rt, self.cfg, self.logger, self.data = runtime, runtime.cfg, logger, data
        s, t = self.cfg.sft, self.cfg.trainer
        self.dp_size = runtime.actor.mesh[0].dp_size
        self.batches = SFTBatches(data.train, s.batch_size, s.shuffle, s.seed)
        self.val_batches = eval_batches(data.val, s.batch_size, self.dp_size) if data.val is not None else []
        self.total_steps = data.total_steps
        self.checkpointer = checkpoints.RunCheckpointer(runtime.run_dir, t.max_checkpoints)
        self.resume_from, self.start_step = resume, 0
        self.last_checkpoint = resume[0] if resume else None
        # run_state's view of the loop: a step is one update, so the weights' version is the step
        self.weight_version = self.actor_version = self.data_cursor = 0
        self.kl_ctrl = self.scorer = None
        self._carried: dict[str, float] = {}  # a checkpoint save's time, logged with the next step
        self.mfu: StepMfu | None = None
        self.stop = stop if stop is not None else GracefulStop(t.stop_grace_s)
        self.stopped: Stopped | None = None

    def fit(self) -> None:
        """Every step's update, then val loss, metrics and a checkpoint when due; at the end the
        policy exported. SIGTERM, SIGUSR1 or Ctrl-C: the step finishes, a checkpoint is saved and
        fit returns with `stopped` set."""
        self.mfu = StepMfu.for_run(self.rt.model_path, self.rt.actor, self.cfg, epochs=1)
        if self.resume_from is not None:
            run_state.restore(self, *self.resume_from)
        step = self.start_step
        with self.stop.handling(*STOP_SIGNALS):
            while step < self.total_steps and not (self.stop.requested and step > self.start_step):
                step += 1
                self.finish_step(step, self.train_step(step))
            if step < self.total_steps:  # a signal: its checkpoint (unless just saved), still handled
                if self.last_checkpoint is None or not str(self.last_checkpoint).endswith(f"step_{step:06d}"):
                    run_state.save(self, step, step)
                self.stopped = Stopped(self.stop.signal or "?", step, self.total_steps, str(self.last_checkpoint))
                return
        if self.cfg.trainer.export_hf:
            run_state.export_hf(self)

    def train_step(self, step: int) -> dict:
        """One optimizer step on step `step`'s batch: sft/loss (the token mean over the whole
        batch), the tokens it trained on and read, and the step's time and throughput."""
        timing: dict = {}
        start = time.perf_counter()
        batch = self.batches.batch_at(step - 1)
        if self.cfg.trainer.balance_batch and self.dp_size > 1:
            batch = batch[balance_across_ranks(self._lengths(batch), self.dp_size)]
        with timer(timing, "update"):
            per_rank = self.rt.actor.update_actor(batch, len(batch), 1, 1.0, self.cfg.trainer.seed + step)
        finite.check_ranks(per_rank, "sft update", step, self.weight_version)
        self.weight_version = self.actor_version = self.data_cursor = step
        metrics = average(per_rank)
        metrics["sft/loss"] = batch_loss(metrics)
        lengths = self._lengths(batch)
        metrics.update(
            {
                "sft/loss_tokens": float(batch["response_mask"].sum()),
                "sft/tokens": float(sum(lengths)),
                "sft/epoch": float(batch.meta["epoch"]),
            }
        )
        timing["perf/step_s"] = time.perf_counter() - start
        timing["perf/tokens_per_s"] = sum(lengths) / timing["perf/step_s"]
        timing.update(self.mfu.metrics(lengths, timing))
        return {**metrics, **timing}

    def finish_step(self, step: int, metrics: dict) -> None:
        """Val loss when due (every trainer.val_every steps and after the last, with sft.val_files),
        log the step's metrics, save when due."""
        t, metrics = self.cfg.trainer, {**metrics, **self._carried}
        self._carried = {}
        if self.val_batches and ((t.val_every and step % t.val_every == 0) or step == self.total_steps):
            metrics.update(self.validate())
        self.logger.log(step, metrics)  # flushed before the save: a checkpoint's steps are all logged
        if t.save_every and (step % t.save_every == 0 or step == self.total_steps):
            run_state.save(self, step, step)

    def validate(self) -> dict:
        """val/sft/loss: the token-mean NLL of the val conversations' assistant tokens (forward only)."""
        start = time.perf_counter()
        nll = tokens = 0.0
        for batch in self.val_batches:
            log_probs = self.rt.actor.compute_log_prob(batch)["old_log_probs"].double()
            mask = batch["response_mask"].double()
            nll -= float((log_probs * mask).sum())
            tokens += float(mask.sum())
        return {"val/sft/loss": nll / tokens, "val/sft/loss_tokens": tokens, "perf/val_s": time.perf_counter() - start}

    def sync_weights(self) -> dict:
        """No engine holds the weights (run_state.restore asks after loading a checkpoint)."""
        return {}

    def _data_identity(self) -> dict:
        """What a resumed run's data must equal for its batches to continue where the saved run's stopped."""
        s = self.cfg.sft
        return {
            "conversations": len(self.data.train),
            "tokens": self.data.train.tokens(),
            "batch_size": s.batch_size,
            "shuffle": s.shuffle,
            "seed": s.seed,
        }

    @staticmethod
    def _lengths(batch: Batch) -> list[int]:
        return row_lengths(batch["input_ids"], batch["prompt_lengths"], batch["response_mask"]).tolist()
