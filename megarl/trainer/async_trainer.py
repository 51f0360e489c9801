"""The asynchronous loops (trainer.mode), on disaggregated placement: the engines have devices of
their own, so generation need not wait for training.

    one_step_off                                   fully_async
    gen(1) with v0                                 producer thread (async_rollout.py), always on:
    step k:                                          send prompts while admitted -> engines (router)
      start gen(k+1) with v(k-1) -.                  each finished group -> buffer, tagged with the
      train on batch k -> v(k)    -' overlap           version it started generating under
      wait for gen(k+1)                            step k:
      sync v(k) -> engines                           take B groups (drop any older than max_staleness)
                                                     train -> v(k)
                                                     sync v(k): /pause_generation (in_place|retract),
                                                       update, /continue_generation; requests in
                                                       flight carry on with v(k) (partial rollout)

one_step_off trains on rows sampled one version behind (batch 1 excepted); fully_async on rows
up to trainer.max_staleness versions behind, some spanning two versions. The PPO ratio is taken
against the trainer's own log-probs of the version it holds (old_log_probs), and the off-policy
corrections (actor.rollout_is: truncated IS on rollout_log_probs) apply as in the sync loop; the
parity check holds only for rows served by the trainer's version (the others' log-prob
difference is logged: it is how far off-policy they are).

Checkpoint/resume: rollouts in flight at a save are regenerated, never checkpointed. The
checkpoint's data position is the first prompt batch not yet trained on, so a resumed run
generates it again with the checkpoint's weights (one_step_off: the uninterrupted run used the
version before; fully_async: prompts the producer had drawn ahead are drawn again).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time

from megarl.bridge.spec import BridgeSpec
from megarl.trainer.parity import check_parity, engine_versions
from megarl.trainer.sync_trainer import SyncTrainer


def version_number(label) -> int | None:
    """A served weight_version label as the trainer's integer version ("default" is the initial 0)."""
    if label in (None, "", "default"):
        return 0 if label == "default" else None
    try:
        return int(label)
    except (TypeError, ValueError):
        return None


class _AsyncBase(SyncTrainer):
    def _check_parity(self, rows, step: int) -> dict:
        """Rows served by the version the trainer holds are checked as in the sync loop; rows from
        older versions cannot agree with it: their difference is logged, not checked."""
        served = [version_number(v) for v in rows["rollout_weight_version"]]
        if "rollout_start_version" in rows.non_tensors:  # fully_async: a row spans the versions from
            served = [
                None if v is None else min(v, version_number(s))  # the one it started under
                for v, s in zip(served, rows["rollout_start_version"])
            ]
        behind = [self.weight_version - v for v in served if v is not None]
        current = bool(behind) and max(behind) == 0 and len(behind) == len(served)
        bridge = self.cfg.bridge if current else dataclasses.replace(self.cfg.bridge, check_parity=False)
        metrics = check_parity(rows, step, bridge, self.weight_version, lambda: engine_versions(self.rt.fleet))
        if behind:
            metrics["async/staleness_mean"] = sum(behind) / len(behind)
            metrics["async/staleness_max"] = float(max(behind))
        return metrics

    def _watching_ranks(self):
        """The trainer thread calls the actor all the time here, which notices a dead rank; a
        second thread pinging the same ranks would queue behind those calls."""
        return contextlib.nullcontext()

    def _served_version(self) -> str | None:
        return None  # rows may come from older versions by design; their versions are tagged


class OneStepOffTrainer(_AsyncBase):
    """Step k+1's rollout (with the weights of step k-1) runs on a thread while step k trains."""

    def fit(self) -> None:
        from megarl.data.mix import make_prompt_batches

        t = self.cfg.trainer
        self._batches = make_prompt_batches(self.rt.train_data, self.cfg.data)
        from megarl.trainer.mfu import StepMfu

        self.mfu = StepMfu.for_run(self.rt.model_path, self.rt.actor, self.cfg)
        if self.resume_from is not None:
            self.restore(*self.resume_from)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="one-step-off-rollout")
        self._pending: concurrent.futures.Future | None = None
        self._trained_cursor = self.data_cursor  # first prompt batch not trained on yet
        try:
            for step in range(self.start_step + 1, t.total_steps + 1):
                if self._pending is None:  # the first step (or after a resume): nothing overlapped it
                    self._pending = self._start_rollout(step)
                t_wait = time.perf_counter()
                generated, gen_timing, cursor = self._pending.result()
                waited = time.perf_counter() - t_wait
                self._trained_cursor = cursor
                self._pending = self._start_rollout(step + 1) if step < t.total_steps else None
                self.finish_step(
                    step, {**self.train_step(step, generated=generated), **gen_timing, "perf/gen_wait_s": waited}
                )
        finally:
            if self._pending is not None:
                self._pending.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)
        if t.export_hf:
            self.export_hf()

    def _start_rollout(self, step: int) -> concurrent.futures.Future:
        def work():
            timing: dict = {}
            prompts = self._next_prompts()
            generated = self.rollout(step, prompts, timing)
            return generated, timing, self.data_cursor

        return self._pool.submit(work)

    def _before_sync(self, timing: dict) -> None:
        """The engines finish the next step's rollout with the weights they have; then they sync."""
        if self._pending is not None:
            t = time.perf_counter()
            concurrent.futures.wait([self._pending])
            timing["perf/gen_overlap_wait_s"] = time.perf_counter() - t

    def save_checkpoint(self, step: int) -> None:
        """The rows generated ahead (for step+1) are not saved: the checkpoint's data position is
        their prompts', which a resumed run generates again."""
        cursor, self.data_cursor = self.data_cursor, self._trained_cursor
        try:
            super().save_checkpoint(step)
        finally:
            self.data_cursor = cursor


class FullyAsyncTrainer(_AsyncBase):
    """Engines generate continuously (async_rollout.RolloutProducer); each step takes a batch."""

    def fit(self) -> None:
        from megarl.data.mix import make_prompt_batches
        from megarl.trainer.async_rollout import RolloutProducer
        from megarl.trainer.mfu import StepMfu

        t, d = self.cfg.trainer, self.cfg.data
        self._batches = make_prompt_batches(self.rt.train_data, d)
        self.mfu = StepMfu.for_run(self.rt.model_path, self.rt.actor, self.cfg)
        if self.resume_from is not None:
            self.restore(*self.resume_from)
        self.producer = RolloutProducer(
            self.rt,
            self._batches,
            self.data_cursor,
            self._sampling(0, train=True),
            groups_per_step=d.train_batch_size,
            max_staleness=t.max_staleness,
            version=self.weight_version,
            steps=t.total_steps - self.start_step,
        )
        try:
            for step in range(self.start_step + 1, t.total_steps + 1):
                timing: dict = {}
                rows, stats = self.producer.take(self.weight_version, timing)
                generated = self._score_rows(step, rows, timing), stats
                self.data_cursor += 1  # batches consumed: the checkpoint's data position
                metrics = {**self.train_step(step, generated=generated), **timing}
                self.producer.set_version(self.weight_version)
                self.finish_step(step, metrics)
        finally:
            self.producer.stop()
        if t.export_hf:
            self.export_hf()

    def _score_rows(self, step: int, rows, timing: dict):
        from megarl.trainer.step_metrics import timer

        with timer(timing, "reward"):
            rows["raw_scores"] = self._score(rows)
            rows["scores"] = rows["raw_scores"] + self._overlong_penalty(rows)
        if self.cfg.algorithm.adv_estimator == "remax":
            rows["baseline_scores"], remax_metrics = self._remax_baseline(step, rows, timing)
            timing.update(remax_metrics)  # its stats join the step's metrics with the timing
        return rows

    def _bridge_spec(self) -> BridgeSpec:
        """Requests are in flight while weights change: the engines pause them around the update."""
        return dataclasses.replace(
            super()._bridge_spec(), pause_generation=True, pause_mode=self.cfg.trainer.pause_mode
        )
