"""The RL loop: one controller, every heavy step an RPC to a worker group, in every trainer.mode.

    for step in steps:                                 # fit()
        rows = source.rows(step)                       # generate + score (sources.py: sync,
                                                       #   one_step_off, fully_async)
        rows = phases.release_and_balance(rows)        # colocated engines free weights + KV cache
        rows = phases.old_ref_values(rows)             # old (or the rollout's) / ref log-probs, values
        rows = phases.advantages(rows)                 # estimator; KL in the reward when enabled
        phases.update(rows)                            # critic, then actor (Megatron TP/PP/EP/CP)
        phases.sync()                                  # engines re-allocate, bridge pushes weights
                                                       #   (the source waits for or pauses generation)
        finish_step(step, metrics)                     # validation, metrics, checkpoint when due

Consumes prompt batches (data.mix.make_prompt_batches), waits for each phase's worker-group
call, produces one metrics dict per step (metrics.jsonl, tensorboard) and checkpoints. The loop
modes differ only in their rollout source (sources.py): when rows are generated, with which
weights, and what the sync does about generation in flight.

An engine that dies mid-step is restarted by the fleet, given the current weights through
`_resync` before it serves again, and its prompts are re-sent (rollout/retries,
rollout/engine_restarts).

Durability (run_state.py, checkpoints.py): every `trainer.save_every` steps, and after the last,
the run's state goes to a checkpoint; a run started with one (`trainer.resume`) loads it, pushes its
weights to the engines and continues with the next step's batch. With `trainer.deterministic`
every sampling request is seeded from (seed, step, row), so the continued run repeats the
uninterrupted one exactly. At the end the policy is exported as a Hugging Face folder (RUN_DIR/hf).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

import torch

from megarl.algo.kl import make_kl_controller
from megarl.bridge.spec import BridgeSpec
from megarl.data.batch import Batch
from megarl.models.vision import MM_COLUMN
from megarl.reward import take_counts
from megarl.reward.model import RowScorer
from megarl.reward.overlong import overlong_penalty
from megarl.rollout.client.manager import SamplingSpec
from megarl.trainer import checkpoints, finite, parity, phases, run_state, status
from megarl.trainer.dynamic_sampling import fill_informative, informative_groups
from megarl.trainer.metrics import MetricsLogger
from megarl.trainer.mfu import StepMfu
from megarl.trainer.preemption import STOP_SIGNALS, GracefulStop, Stopped
from megarl.trainer.prime import accuracy_filter
from megarl.trainer.rank_watch import RankWatch
from megarl.trainer.remax import remax_baseline
from megarl.trainer.sources import RolloutSource, rollout_source
from megarl.trainer.step_metrics import average, rollout_metrics, timer

if TYPE_CHECKING:
    from megarl.trainer.runtime import Runtime


class Trainer:
    def __init__(
        self,
        runtime: Runtime,
        logger: MetricsLogger,
        resume: tuple | None = None,
        source: RolloutSource | None = None,
        stop: GracefulStop | None = None,
    ):
        """`resume`: (checkpoint dir, its trainer state) to continue from (checkpoints.resume_point);
        `source`: where the rows come from (default: the one trainer.mode names); `stop`: the
        run's signal handling (preemption.py; default: one of its own)."""
        self.rt = runtime
        self.cfg = runtime.cfg
        self.logger = logger
        # rule / custom reward, reward.model, overlap with generation (megarl/reward/model.py)
        self.scorer = RowScorer.of_runtime(runtime)
        self.reward_fn = self.scorer.reward_fn
        self.dp_size = runtime.actor.mesh[0].dp_size
        self.weight_version = 0  # the version the engines hold (after the last sync)
        # the version the actor's weights are: weight_version + 1 between an update and its sync.
        # A restarted engine gets the actor's weights under this label, from whichever thread
        # notices (a rollout thread runs ahead in the async modes); the lock orders it with updates
        self.actor_version, self.actor_lock = 0, threading.Lock()
        self.release = bool(self.cfg.rollout.release_memory)
        self.ref_is_actor = False  # the reference was refreshed after the last update (phases.update)
        self.reuse_rollout_log_probs = self.cfg.actor.old_log_prob == "rollout"  # resolved by validate
        self.resume_from, self.start_step = resume, 0
        self.checkpointer = checkpoints.RunCheckpointer(runtime.run_dir, self.cfg.trainer.max_checkpoints)
        self.last_checkpoint = resume[0] if resume else None
        self._carried: dict[str, float] = {}  # a checkpoint save's time, logged with the next step
        # prompt batches taken so far (one per step, more with dynamic sampling); checkpointed
        self.data_cursor, self.batches = 0, None
        k = self.cfg.algorithm.kl_ctrl  # KL in the reward: its coefficient (adaptive: checkpointed)
        self.kl_ctrl = (
            make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
            if self.cfg.algorithm.use_kl_in_reward
            else None
        )
        self.mfu: StepMfu | None = None  # made by fit(): it asks rank 0 for its device's peak
        self.source = source if source is not None else rollout_source(self)
        self.stop = stop if stop is not None else GracefulStop(self.cfg.trainer.stop_grace_s)
        self.stopped: Stopped | None = None  # set when a signal stopped the run (preemption.py)
        runtime.fleet.on_restart = self._resync

    # ---------------------------------------------------------------- steps
    def fit(self) -> None:
        """Every step: the source's rows through the phases, then validation, metrics and a
        checkpoint when due; at the end the policy exported. SIGTERM, SIGUSR1 or Ctrl-C: the step
        finishes, a checkpoint is saved and fit returns with `stopped` set (preemption.py)."""
        from megarl.data.mix import make_prompt_batches

        t = self.cfg.trainer
        self.batches = make_prompt_batches(self.rt.train_data, self.cfg.data)  # one dataset, or a mix
        self.mfu = StepMfu.for_run(self.rt.model_path, self.rt.actor, self.cfg)
        if self.resume_from is not None:
            self.restore(*self.resume_from)
        step = self.start_step
        if step == 0 and t.val_before_train and self.rt.val_data is not None:  # the initial weights' score
            self.logger.log(0, self.validate(0))
        with self.stop.handling(*STOP_SIGNALS):
            self.source.start()
            try:
                while step < t.total_steps and not (self.stop.requested and step > self.start_step):
                    step += 1
                    self.finish_step(step, self.train_step(step))
            finally:
                self.source.stop()  # nothing generates while a stop's checkpoint is written
            if step < t.total_steps:
                self._stop_at(step)
                return
        if t.export_hf:
            self.export_hf()

    def _stop_at(self, step: int) -> None:
        """A signal asked the run to stop after `step`: its checkpoint (unless just saved)."""
        if self.last_checkpoint is None or not str(self.last_checkpoint).endswith(f"step_{step:06d}"):
            self.save_checkpoint(step)
        self.stopped = Stopped(self.stop.signal or "?", step, self.cfg.trainer.total_steps, str(self.last_checkpoint))

    def finish_step(self, step: int, metrics: dict) -> None:
        """Validate when due, log the step's metrics, save when due."""
        t, metrics = self.cfg.trainer, {**metrics, **self._carried}
        self._carried = {}
        if self.rt.val_data is not None and t.val_every and (step % t.val_every == 0 or step == t.total_steps):
            metrics.update(self.validate(step))
        self.logger.log(step, metrics)  # flushed before the save: a checkpoint's steps are all logged
        if t.save_every and (step % t.save_every == 0 or step == t.total_steps):
            self.save_checkpoint(step)

    # ---------------------------------------------------------------- durability
    def save_checkpoint(self, step: int) -> None:
        run_state.save(self, step, self.source.data_position())

    def restore(self, path, state: dict) -> None:
        """Continue after the checkpoint at `path` (run_state.restore)."""
        run_state.restore(self, path, state)

    def export_hf(self) -> None:
        run_state.export_hf(self)

    def _data_identity(self) -> dict:
        return run_state.data_identity(self)

    def rollout(self, step: int, prompts: Batch, timing: dict) -> tuple[Batch, dict]:
        """The step's scored rows and rollout stats (ReMax: with their greedy baselines)."""
        rows, rollout_stats = self._generate_scored(step, prompts, timing)
        if self.cfg.algorithm.adv_estimator == "remax":  # its baseline: the greedy response's score
            rows["baseline_scores"], remax_metrics = remax_baseline(self, step, rows, timing)
            rollout_stats.update(remax_metrics)
        return rows, rollout_stats

    def score_generated(self, step: int, rows: Batch, timing: dict) -> Batch:
        """Scores (and ReMax's greedy baselines) for rows generated elsewhere (fully_async's
        producer); the baselines' stats join `timing`."""
        with timer(timing, "reward"):
            rows["raw_scores"] = self._score(rows)
            rows["scores"] = rows["raw_scores"] + self._overlong_penalty(rows)
        if self.cfg.algorithm.adv_estimator == "remax":
            rows["baseline_scores"], remax_metrics = remax_baseline(self, step, rows, timing)
            timing.update(remax_metrics)
        return rows

    def train_step(self, step: int, prompts: Batch | None = None) -> dict:
        """One step on the source's next rows, or on rows generated now from `prompts`. The
        phases, in order (phases.py). perf/step_s: from asking for the rows to the end of the sync."""
        timing: dict = {}
        t_step, restarts_before = time.perf_counter(), self.rt.fleet.restarts
        if prompts is not None:
            rows, rollout_stats = self.rollout(step, prompts, timing)
        else:
            rows, rollout_stats = self.source.rows(step, timing)
        rows = phases.release_and_balance(self, rows, timing)
        # the rollout's log-probs as the old policy's (actor.old_log_prob=rollout) only where the
        # rows were sampled with the actor's current weights (validate allows it only then)
        reuse = self.reuse_rollout_log_probs and not self.source.off_policy
        rows, parity = phases.old_ref_values(self, rows, step, timing, reuse)
        finite.check_rows(rows, finite.ROLLOUT_AND_OLD, "old/ref/values", step, self.weight_version)
        rows, kl_metrics = phases.advantages(self, rows, timing, step)
        finite.check_rows(rows, finite.ADVANTAGES, "advantages", step, self.weight_version)
        per_rank, critic_metrics, trained = phases.update(self, rows, step, timing, reuse)
        finite.check_ranks(critic_metrics or [], "critic update", step, self.weight_version)
        finite.check_ranks(per_rank, "actor update", step, self.weight_version)  # before the sync
        if reuse:
            parity = self._update_parity(per_rank, step)
        bridge_stats = phases.sync(self, timing)
        self.source.after_sync()
        timing["perf/step_s"] = time.perf_counter() - t_step
        if self.mfu is not None:
            timing.update(self.mfu.metrics(self._token_lengths(rows), timing, self._token_lengths(trained)))
        # engines restarted anywhere in the step: in generation, memory release/resume or the sync
        rollout_stats["rollout/engine_restarts"] = float(self.rt.fleet.restarts - restarts_before)
        return {
            **rollout_metrics(rows, self.cfg.reward.overlong_buffer.enable),
            **rollout_stats,
            **parity,
            **average(per_rank),
            **timing,
            **kl_metrics,
            **average(critic_metrics or []),
            **take_counts(),
            **self.scorer.take_metrics(),
            **{k: float(v) for k, v in bridge_stats.items() if k.startswith("bridge/")},
        }

    def sync_weights(self) -> dict:
        """Push the actor's weights to every engine; returns the bridge's stats (rank 0's). An
        engine that died since the rollout makes the push fail (the engines that are alive keep
        their previous weights: a sync is all or nothing): the fleet restarts it (it gets these
        weights through _resync) and the push is repeated for all engines."""
        from megarl.controller.worker_group import WorkerError

        self.rt.fleet.finish_recovery(only_ready=True)  # engines restarted meanwhile rejoin first
        try:
            stats = self.rt.actor.sync_weights(self._bridge_spec(), str(self.weight_version)) or {}
        except WorkerError:
            if not self.rt.fleet.recover(wait=True):
                raise  # every engine is alive: the failure is not a dead engine's
            stats = self.rt.actor.sync_weights(self._bridge_spec(), str(self.weight_version)) or {}
        if self.cfg.bridge.transport == "adapter":  # the engines hold the policy as a LoRA adapter now
            from megarl.bridge.adapter import ADAPTER_NAME

            self.rt.rollout.use_lora_adapter(ADAPTER_NAME)
        return stats

    def _resync(self, urls: list[str]) -> None:
        """A restarted engine gets the actor's weights, labelled with their version, before it
        takes requests (the others' version, or the next one when an update has run since)."""
        with self.actor_lock:
            self.rt.actor.sync_weights(self._bridge_spec(), str(self.actor_version), urls)

    def validate(self, step: int) -> dict:
        """trainer.val_n samples of every val prompt; val/* metrics per data_source (validation.py)."""
        from megarl.trainer.validation import run_validation

        def generate(prompts: Batch) -> Batch:
            with self._watching_ranks():
                return self.rt.rollout.generate(prompts, self.sampling(step, train=False), self._served_version())

        t, score = self.cfg.trainer, lambda rows: self._score(rows, train=False)  # noqa: E731
        metrics = run_validation(self.rt.val_data, generate, score, t.val_n, t.val_pass_threshold)
        # validation's model-reward counters: val/reward/..., val/perf/...
        return {**metrics, **{f"val/{k}": v for k, v in self.scorer.take_metrics().items()}}

    # ---------------------------------------------------------------- pieces
    def next_prompts(self) -> Batch:
        prompts = self.batches.batch_at(self.data_cursor)
        self.data_cursor += 1
        return prompts

    def _generate_scored(self, step: int, prompts: Batch, timing: dict) -> tuple[Batch, dict]:
        """The step's scored rows. With algorithm.filter_groups: only groups whose responses scored
        differently, generating from the next prompt batches until a batch is full
        (dynamic_sampling.py); the rounds' rollout stats add up."""
        f = self.cfg.algorithm.filter_groups
        stats: dict[str, float] = {}

        def generate(k: int) -> Batch:
            batch = prompts if k == 0 else self.next_prompts()
            overlap = self.scorer.start_overlap(batch, self.cfg.rollout.n)  # None: reward.overlap off
            with timer(timing, "gen"), self._watching_ranks():
                rows = self.rt.rollout.generate(
                    batch,
                    self.sampling(step, train=True, round_=k),
                    self._served_version(),
                    on_rows=status.counting(overlap and overlap.on_rows, len(batch) * self.cfg.rollout.n),
                )
            for key, value in self.rt.rollout.last_stats.items():
                stats[key] = stats.get(key, 0.0) + float(value)
            with timer(timing, "reward"):
                rows["raw_scores"] = overlap.collect(rows) if overlap else self._score(rows)
                rows["scores"] = rows["raw_scores"] + self._overlong_penalty(rows)
            return rows

        keep = accuracy_filter(self.cfg)  # PRIME's accuracy band, in place of DAPO's filter
        if not (f.enable or keep):
            return generate(0), stats
        every: list[torch.Tensor] = []  # all rounds' scores: the policy's reward before the filter

        def generate_all(k: int) -> Batch:
            rows = generate(k)
            every.append(rows["raw_scores"])
            return rows

        rows, filled = fill_informative(
            generate_all,
            self.cfg.data.train_batch_size,
            f.max_num_gen_batches,
            pad=f.on_exhausted == "pad",
            keep=keep or informative_groups,
        )
        return rows, {**stats, **filled, "reward/generated_mean": float(torch.cat(every).mean())}

    def _rewards(self, rows: Batch) -> tuple[torch.Tensor, dict]:
        """The estimator's rewards: the scores, or with algorithm.use_kl_in_reward token-level
        rewards (the score on the last response token) minus kl_ctrl's coefficient times the
        per-token KL to the reference; the controller then adapts to the KL it saw."""
        if self.kl_ctrl is None:
            return rows["scores"], {}
        from megarl.algo.kl import apply_kl_penalty, token_level_scores

        a = self.cfg.algorithm
        rewards, metrics = apply_kl_penalty(
            token_level_scores(rows["scores"], rows["response_mask"]),
            rows["old_log_probs"],
            rows["ref_log_probs"],
            rows["response_mask"],
            self.kl_ctrl.value,
            a.kl_penalty,
        )
        self.kl_ctrl.update(metrics["kl_reward/kl"], n_steps=len(rows))
        return rewards, metrics

    def _overlong_penalty(self, rows: Batch) -> torch.Tensor:
        o = self.cfg.reward.overlong_buffer
        if not o.enable:
            return torch.zeros(len(rows))
        return overlong_penalty(rows["response_mask"].sum(1), self.cfg.rollout.max_new_tokens, o.len, o.penalty_factor)

    def _served_version(self) -> str | None:
        """The version every rollout answer must report. Version 0 is the initial checkpoint, which
        every engine loads (labelled "default", or "0" after a restart's resync): not checked. An
        off-policy source's rows come from older versions by design; their versions are tagged."""
        return str(self.weight_version) if self.weight_version and not self.source.off_policy else None

    def _watching_ranks(self) -> contextlib.AbstractContextManager:
        """Generation calls no rank: a rank dying meanwhile aborts it and is raised (rank_watch.py).
        Under an off-policy source the trainer calls the actor all the time, which notices a dead
        rank; a second thread pinging the same ranks would queue behind those calls."""
        if self.source.off_policy:
            return contextlib.nullcontext()
        # the fleet makes its own clients: the manager's belong to the main thread
        return RankWatch([self.rt.actor, self.rt.critic, self.rt.prm], lambda: self.rt.fleet.abort_all_requests())

    def sampling(self, step: int, train: bool, round_: int = 0) -> SamplingSpec:
        """round_: a step's k-th generation round (dynamic sampling); its own seeds."""
        r, t = self.cfg.rollout, self.cfg.trainer
        seed = (t.seed, step, 0 if train else 1) + ((round_,) if round_ else ())
        return SamplingSpec(
            n=r.n if train else t.val_n,
            temperature=r.temperature if train else r.val_temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            seed=seed if t.deterministic else None,
            return_routed_experts=train and self.cfg.actor.moe.routing_replay,
        )

    def _score(self, rows: Batch, train: bool = True) -> torch.Tensor:  # train: normalisation stats
        return self.scorer.score_batch(rows, train)

    @staticmethod
    def _token_lengths(rows: Batch) -> list[int]:
        from megarl.engine.megatron.packing import row_lengths  # tool tokens (mask 0) inside count

        return row_lengths(rows["input_ids"], rows["prompt_lengths"], rows["response_mask"]).tolist()

    def _trainer_view(self, rows: Batch, *extra: str) -> Batch:
        """Only the tensors the engine reads travel to the workers."""
        keys = ["input_ids", "prompt_lengths", "responses", "response_mask", *extra]
        keys += ["routed_experts"] if "routed_experts" in rows else []  # actor.moe.routing_replay
        keys += ["rollout_versions"] if "rollout_versions" in rows and "rollout_log_probs" in keys else []
        view = Batch({k: rows[k] for k in keys})
        if MM_COLUMN in rows:  # a vision-language model's images (engine/megatron/vision_inputs.py)
            view[MM_COLUMN] = rows[MM_COLUMN]
        if len(view) % self.dp_size:
            raise ValueError(
                f"{len(view)} rows do not split over {self.dp_size} data-parallel "
                "ranks; make data.train_batch_size * rollout.n divisible by dp"
            )
        return view

    def _start_probe(self, rows: Batch) -> parity.Probe | None:
        """Under an off-policy source, every engine starts scoring a few of the step's rows under
        the weights it holds (the last sync's check, parity.py); None elsewhere."""
        b = self.cfg.bridge
        if not (self.source.off_policy and b.check_parity and b.parity_probe_rows):
            return None
        routed = self.cfg.actor.moe.routing_replay
        return parity.start_probe(rows, self.rt.fleet, self.cfg.rollout.temperature, b.parity_probe_rows, routed)

    def _check_parity(self, rows: Batch, step: int, probe: parity.Probe | None = None) -> dict:
        """The server sampled with the weights the trainer just scored with (parity.py). Under an
        off-policy source the rows served by that version are checked, and the engines' scores of
        the probe rows are judged. perf/parity_probe_s: what the probe added to the step."""
        b, versions = self.cfg.bridge, lambda: parity.engine_versions(self.rt.fleet)
        if not self.source.off_policy:
            return parity.check_parity(rows, step, b, self.weight_version, versions)
        metrics = parity.check_current_rows(rows, step, b, self.weight_version, versions)
        if probe is not None:
            t = time.perf_counter()
            replay = self._replayed_log_probs if self.cfg.actor.moe.routing_replay else None
            metrics.update(parity.judge_probe(probe, rows, step, b, self.weight_version, replay))
            metrics["perf/parity_probe_s"] = time.perf_counter() - t
        return metrics

    def _replayed_log_probs(self, rows: Batch) -> torch.Tensor:
        """The actor's log-probs of `rows` replaying their routed_experts (the probe's judge)."""
        view = self._trainer_view(Batch.concat([rows] * self.dp_size))  # splits over any dp
        return self.rt.actor.compute_log_prob(view, self.cfg.rollout.temperature)["old_log_probs"][: len(rows)]

    def _update_parity(self, per_rank: list[dict], step: int) -> dict:
        """actor.old_log_prob=rollout: the check on the update's first mini-batch (parity.py)."""
        versions = lambda: parity.engine_versions(self.rt.fleet)  # noqa: E731  (asked only when the check fails)
        return parity.check_update_parity(per_rank, step, self.cfg.bridge, self.weight_version, versions)

    def _bridge_spec(self) -> BridgeSpec:
        """The sync's spec; the source pauses generation in flight around it (fully_async)."""
        b = self.cfg.bridge
        spec = BridgeSpec(
            transport=b.transport,
            server_urls=tuple(self.rt.server_urls),
            api_key=self.rt.fleet.api_key,
            bucket_bytes=int(b.bucket_size_mb * 2**20),
            disk_dir=str(self.rt.run_dir / "weights"),
            timeout_s=self.cfg.rollout.request_timeout_s,
            pause_generation=False,
        )
        return self.source.bridge_spec(spec)
