"""Where a step's rows come from: the loop modes (trainer.mode) as rollout sources of one Trainer.

The Trainer (loop.py) runs the same step in every mode; a source decides when its rows are
generated and with which weights, and what the sync must do about generation in flight:

    sync                                 one_step_off                    fully_async
    step k:                              gen(1) with v0                  producer thread, always on
      gen + score batch k with v(k-1)    step k:                         (async_rollout.py):
      train -> v(k)                        take gen(k), start gen(k+1)     send prompts while
      sync v(k)                              with v(k-1) on a thread       admitted; each finished
                                           train on batch k -> v(k)        group -> buffer, tagged
                                           wait for gen(k+1)  <- before    with its start version
                                           sync v(k) -> engines   _sync    step k: take B groups,
                                                                           score, train -> v(k),
                                                                           sync v(k): pause, update,
                                                                           continue (in flight:
                                                                           partial rollout)

one_step_off trains on rows sampled one version behind (batch 1 excepted); fully_async on rows
up to trainer.max_staleness versions behind, some spanning two versions (`off_policy`). The PPO
ratio is taken against the trainer's own log-probs of the version it holds (old_log_probs), and
the off-policy corrections (actor.rollout_is) apply as in the sync loop; the parity check holds
for rows served by the trainer's version (parity.check_current_rows).

Checkpoint/resume: rollouts in flight at a save are regenerated, never checkpointed. A source's
`data_position` is the first prompt batch not yet trained on, so a resumed run generates it again
with the checkpoint's weights (one_step_off: the uninterrupted run used the version before;
fully_async: prompts the producer had drawn ahead are drawn again).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import TYPE_CHECKING, Protocol

from megarl.trainer import status
from megarl.trainer.step_metrics import timer

if TYPE_CHECKING:
    from megarl.bridge.spec import BridgeSpec
    from megarl.config.schema import RunConfig
    from megarl.data.batch import Batch
    from megarl.rollout.client.manager import SamplingSpec
    from megarl.trainer.runtime import Runtime


class Host(Protocol):
    """What a source uses of the Trainer that drives it."""

    rt: Runtime
    cfg: RunConfig
    weight_version: int
    data_cursor: int  # prompt batches taken so far
    start_step: int
    batches: object  # the run's prompt batches (data.mix.make_prompt_batches)

    def next_prompts(self) -> Batch: ...
    def rollout(self, step: int, prompts: Batch, timing: dict) -> tuple[Batch, dict]: ...
    def score_generated(self, step: int, rows: Batch, timing: dict) -> Batch: ...
    def sampling(self, step: int, train: bool, round_: int = 0) -> SamplingSpec: ...


class RolloutSource(Protocol):
    """A loop mode: the rows of every step, and what it needs around the weight sync."""

    off_policy: bool  # rows may come from older weight versions, generated while the trainer trains

    def start(self) -> None:
        """fit() begins (after a resume): start generating ahead, if this source does."""

    def rows(self, step: int, timing: dict) -> tuple[Batch, dict]:
        """The step's scored rows and its rollout stats; seconds in `timing`."""

    def before_sync(self, timing: dict) -> None:
        """The weights are about to move: wait for what must finish on the old ones."""

    def after_sync(self) -> None:
        """The engines hold the trainer's new version."""

    def bridge_spec(self, spec: BridgeSpec) -> BridgeSpec:
        """The sync's spec, adjusted for generation in flight."""

    def data_position(self) -> int:
        """What a checkpoint saves as the data position: the first prompt batch not trained on."""

    def stop(self) -> None:
        """fit() ends (or fails): stop generating, join threads."""


class OnPolicy:
    """trainer.mode=sync: each step generates and scores its own batch with the weights it trains."""

    off_policy = False

    def __init__(self, host: Host):
        self.host = host

    def start(self) -> None:
        pass

    def rows(self, step: int, timing: dict) -> tuple[Batch, dict]:
        prompts = self.host.next_prompts()
        rows, stats = self.host.rollout(step, prompts, timing)
        return rows, {**stats, **prompts.meta.get("metrics", {})}

    def before_sync(self, timing: dict) -> None:
        pass

    def after_sync(self) -> None:
        pass

    def bridge_spec(self, spec: BridgeSpec) -> BridgeSpec:
        return spec  # the sync comes after generation finished: nothing to pause

    def data_position(self) -> int:
        return self.host.data_cursor

    def stop(self) -> None:
        pass


class OneStepOff(OnPolicy):
    """trainer.mode=one_step_off: step k+1's rollout (with the weights of step k-1) runs on a
    thread while step k trains; the engines finish it before they get step k's weights."""

    off_policy = True

    def __init__(self, host: Host):
        super().__init__(host)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._trained = host.data_cursor  # first prompt batch not trained on yet

    def start(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="one-step-off-rollout")
        self._trained = self.host.data_cursor

    def rows(self, step: int, timing: dict) -> tuple[Batch, dict]:
        if self._pending is None:  # the first step (or after a resume): nothing overlapped it
            self._pending = self._start(step)
        with timer(timing, "gen_wait"):
            rows, stats, gen_timing, self._trained = self._pending.result()
        timing.update(gen_timing)
        self._pending = self._start(step + 1) if step < self.host.cfg.trainer.total_steps else None
        return rows, stats

    def _start(self, step: int) -> concurrent.futures.Future:
        def work():
            timing: dict = {}
            rows, stats = super(OneStepOff, self).rows(step, timing)
            return rows, stats, timing, self.host.data_cursor

        assert self._pool is not None, "OneStepOff.rows before start()"
        return self._pool.submit(work)

    def before_sync(self, timing: dict) -> None:
        """The engines finish the next step's rollout with the weights they have; then they sync."""
        if self._pending is not None:
            with timer(timing, "gen_overlap_wait"):
                concurrent.futures.wait([self._pending])

    def data_position(self) -> int:
        """The rows generated ahead (for the next step) are not saved: the checkpoint's data
        position is their prompts', which a resumed run generates again."""
        return self._trained

    def stop(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class FullyAsync(OnPolicy):
    """trainer.mode=fully_async: the engines generate continuously (async_rollout.RolloutProducer);
    each step takes a batch of finished groups and scores it."""

    off_policy = True

    def __init__(self, host: Host):
        super().__init__(host)
        self.producer = None

    def start(self) -> None:
        from megarl.trainer.async_rollout import RolloutProducer

        h, t = self.host, self.host.cfg.trainer
        self.producer = RolloutProducer(
            h.rt,
            h.batches,
            h.data_cursor,
            h.sampling(0, train=True),
            groups_per_step=h.cfg.data.train_batch_size,
            max_staleness=t.max_staleness,
            version=h.weight_version,
            steps=t.total_steps - h.start_step,
        )

    def rows(self, step: int, timing: dict) -> tuple[Batch, dict]:
        assert self.producer is not None, "FullyAsync.rows before start()"
        with status.phase("wait for rows"):  # the producer's finished groups (perf/wait_s)
            rows, stats = self.producer.take(self.host.weight_version, timing)
        rows = self.host.score_generated(step, rows, timing)
        self.host.data_cursor += 1  # batches consumed: the checkpoint's data position
        return rows, stats

    def after_sync(self) -> None:
        self.producer.set_version(self.host.weight_version)  # admission moves on

    def bridge_spec(self, spec: BridgeSpec) -> BridgeSpec:
        """Requests are in flight while weights change: the engines pause them around the update."""
        return dataclasses.replace(spec, pause_generation=True, pause_mode=self.host.cfg.trainer.pause_mode)

    def stop(self) -> None:
        if self.producer is not None:
            self.producer.stop()


SOURCES: dict[str, type[OnPolicy]] = {"sync": OnPolicy, "one_step_off": OneStepOff, "fully_async": FullyAsync}


def rollout_source(host: Host) -> RolloutSource:
    """The source trainer.mode names."""
    return SOURCES[host.cfg.trainer.mode](host)
