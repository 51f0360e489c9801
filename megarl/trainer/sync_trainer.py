"""The synchronous RL loop: one controller, every heavy step an RPC to a worker group.

    for step in steps:
        rows = rollout.generate(prompts)          # SGLang-API engines (behind sglang-router)
        fleet.release_memory()                    # colocated: engines free weights + KV cache
        rows = reward(rows)                       # rule verifiers by data_source
        rows |= actor.compute_log_prob(rows)      # Megatron, DP_COMPUTE
        rows |= actor.compute_ref_log_prob(rows)  # colocated reference (when KL is on)
        rows["advantages"] = compute_advantages(algorithm.adv_estimator, ...)
        actor.update_actor(rows)                  # Megatron TP/PP/EP + distributed optimizer
        fleet.resume_memory(weights)              # colocated: re-allocate before the sync fills them
        actor.sync_weights(engines)               # bucketed weight stream -> every engine directly
        fleet.resume_memory(kv_cache)

An engine that dies mid-step is restarted by the fleet, given the current weights through
`_resync` before it serves again, and its prompts are re-sent (rollout/retries,
rollout/engine_restarts).

Durability (trainer/checkpoints.py): every `trainer.save_every` steps, and after the last, the
actor (and critic), the step, weight version, data position and the controller's RNG go to a
checkpoint; a run started with one (`trainer.resume`) loads it, pushes its weights to the engines
and continues with the next step's batch. With `trainer.deterministic` every sampling request is
seeded from (seed, step, row), so the continued run repeats the uninterrupted one exactly. At the
end the policy is exported as a Hugging Face folder (RUN_DIR/hf).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from megarl.algo.advantages import compute_advantages
from megarl.algo.kl import make_kl_controller
from megarl.algo.losses import masked_mean
from megarl.bridge.spec import BridgeSpec
from megarl.data.balance import balance_across_ranks
from megarl.data.batch import Batch
from megarl.reward import take_counts
from megarl.reward.model import RowScorer
from megarl.reward.overlong import overlong_penalty
from megarl.rollout.client.manager import SamplingSpec
from megarl.trainer import checkpoints
from megarl.trainer.dynamic_sampling import fill_informative
from megarl.trainer.metrics import MetricsLogger
from megarl.trainer.mfu import StepMfu
from megarl.trainer.parity import check_parity, check_update_parity, engine_versions
from megarl.trainer.rank_watch import RankWatch


class SyncTrainer:
    def __init__(self, runtime, logger: MetricsLogger, resume: tuple | None = None):
        """`resume`: (checkpoint dir, its trainer state) to continue from (checkpoints.resume_point)."""
        self.rt = runtime
        self.cfg = runtime.cfg
        self.logger = logger
        # rule / custom reward, reward.model, overlap with generation (megarl/reward/model.py)
        self.scorer = RowScorer(self.cfg.reward, getattr(runtime, "reward_model_url", None))
        self.reward_fn = self.scorer.reward_fn
        self.dp_size = runtime.actor.mesh[0].dp_size
        self.weight_version = 0
        self.release = bool(self.cfg.rollout.release_memory)
        self.reuse_rollout_log_probs = self.cfg.actor.old_log_prob == "rollout"  # resolved by validate
        self.resume_from, self.start_step = resume, 0
        self.checkpointer = checkpoints.RunCheckpointer(runtime.run_dir, self.cfg.trainer.max_checkpoints)
        self.last_checkpoint = resume[0] if resume else None
        self._carried: dict[str, float] = {}  # a checkpoint save's time, logged with the next step
        # prompt batches taken so far (one per step, more with dynamic sampling); checkpointed
        self.data_cursor, self._batches = 0, None
        k = self.cfg.algorithm.kl_ctrl  # KL in the reward: its coefficient (adaptive: checkpointed)
        self.kl_ctrl = (
            make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
            if self.cfg.algorithm.use_kl_in_reward
            else None
        )
        self.mfu: StepMfu | None = None  # made by fit(): it asks rank 0 for its device's peak
        runtime.fleet.on_restart = self._resync

    # ---------------------------------------------------------------- steps
    def fit(self) -> None:
        from megarl.data.mix import make_prompt_batches

        d, t = self.cfg.data, self.cfg.trainer
        batches = make_prompt_batches(self.rt.train_data, d)  # one dataset, or a weighted mix
        self.mfu = StepMfu.for_run(self.rt.model_path, self.rt.actor, self.cfg)
        if self.resume_from is not None:
            self.restore(*self.resume_from)
        self._batches = batches
        for step in range(self.start_step + 1, t.total_steps + 1):
            prompts = self._next_prompts()
            self.finish_step(step, {**self.train_step(step, prompts), **prompts.meta.get("metrics", {})})
        if t.export_hf:
            self.export_hf()

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
        start = time.perf_counter()
        partial = self.checkpointer.begin(step)
        self.rt.actor.save_checkpoint(str(partial / "actor"))
        if self.rt.critic is not None:
            self.rt.critic.save_checkpoint(str(partial / "critic"))
        state = {
            "weight_version": self.weight_version,
            "data": self._data_identity(),
            "data_cursor": self.data_cursor,
            "kl_coef": self.kl_ctrl.value if self.kl_ctrl is not None else None,
            "driver_rng": checkpoints.driver_rng_state(),
            "model_path": self.rt.model_path,
        }
        from megarl.config.loader import dump

        self.last_checkpoint = self.checkpointer.commit(step, partial, state, dump(self.cfg))
        self._carried["perf/checkpoint_save_s"] = time.perf_counter() - start
        self.logger.note(f"saved checkpoint {self.last_checkpoint} ({self._carried['perf/checkpoint_save_s']:.1f} s)")

    def restore(self, path, state: dict) -> None:
        """Continue after the checkpoint at `path`: policy (and critic) with their optimizers and
        RNG, the controller's RNG, the weight version; the engines get the checkpoint's weights."""
        if state["data"] != self._data_identity():
            raise checkpoints.ResumeRefused(
                f"{path} was saved by a run whose data was {state['data']}, this run's is "
                f"{self._data_identity()}: its batches would not continue where that run stopped. "
                "Restore those data settings, or start a new run (trainer.experiment_name)"
            )
        start = time.perf_counter()
        self.rt.actor.load_checkpoint(str(path / "actor"))
        if self.rt.critic is not None:
            if not (path / "critic").is_dir():
                raise checkpoints.ResumeRefused(
                    f"{path} holds no critic/ (saved by a run without "
                    "critic.enabled); resume it with critic.enabled=false"
                )
            self.rt.critic.load_checkpoint(str(path / "critic"))
        checkpoints.set_driver_rng_state(state["driver_rng"])
        self.start_step, self.weight_version = int(state["step"]), int(state["weight_version"])
        self.data_cursor = int(state.get("data_cursor", self.start_step))
        if self.kl_ctrl is not None and state.get("kl_coef") is not None:
            self.kl_ctrl.value = float(state["kl_coef"])
        self.sync_weights()  # the engines still hold the initial model
        self.logger.note(
            f"resumed from {path} (step {self.start_step}, weight version "
            f"{self.weight_version}) in {time.perf_counter() - start:.1f} s"
        )

    def export_hf(self) -> None:
        out = self.rt.run_dir / "hf"
        info = self.rt.actor.export_hf(str(out), self.rt.model_path)
        self.logger.note(
            f"exported the policy as a Hugging Face model: {out} "
            f"({info['tensors']} tensors, {info['bytes'] / 2**20:.1f} MiB)"
        )

    def _data_identity(self) -> dict:
        from megarl.data.mix import data_mix_identity

        d = self.cfg.data
        return {
            "prompts": len(self.rt.train_data),
            "train_batch_size": d.train_batch_size,
            "shuffle": d.shuffle,
            "seed": d.seed,
            **data_mix_identity(self.rt.train_data),
        }

    def rollout(self, step: int, prompts: Batch, timing: dict) -> tuple[Batch, dict]:
        """The step's scored rows and rollout stats (ReMax: with their greedy baselines)."""
        rows, rollout_stats = self._generate_scored(step, prompts, timing)
        if self.cfg.algorithm.adv_estimator == "remax":  # its baseline: the greedy response's score
            rows["baseline_scores"], remax_metrics = self._remax_baseline(step, rows, timing)
            rollout_stats.update(remax_metrics)
        return rows, rollout_stats

    def train_step(self, step: int, prompts: Batch | None = None, generated: tuple | None = None) -> dict:
        """One step on `prompts`, or on rows an asynchronous loop generated already (`generated`:
        rollout()'s answer; trainer/async_trainer.py)."""
        cfg, timing = self.cfg, {}
        t_step, restarts_before = time.perf_counter(), self.rt.fleet.restarts
        rows, rollout_stats = generated if generated is not None else self.rollout(step, prompts, timing)
        if self.release:
            with _timer(timing, "release"):
                self.rt.fleet.release_memory(["weights", "kv_cache"])
        if cfg.trainer.balance_batch and self.dp_size > 1:
            rows = rows[balance_across_ranks(self._token_lengths(rows), self.dp_size)]
        # the rollout's log-probs as the old policy's (actor.old_log_prob=rollout) only where the
        # rows were sampled with the actor's current weights: not rows an async loop generated
        reuse = self.reuse_rollout_log_probs and generated is None
        if reuse:  # checked against the update's first mini-batch instead (_update_parity)
            rows["old_log_probs"] = rows["rollout_log_probs"].to(torch.float32)
            parity = {}
        else:
            with _timer(timing, "old_log_prob"):
                rows = rows.union(self.rt.actor.compute_log_prob(self._trainer_view(rows), cfg.rollout.temperature))
            parity = self._check_parity(rows, step)
        if cfg.ref.enabled:
            with _timer(timing, "ref"):
                rows = rows.union(self.rt.actor.compute_ref_log_prob(self._trainer_view(rows), cfg.rollout.temperature))
        if self.rt.critic is not None:  # PPO: the value function's estimate at every response token
            with _timer(timing, "values"):
                rows = rows.union(self.rt.critic.compute_values(self._trainer_view(rows)))
        with _timer(timing, "adv"):
            a = cfg.algorithm
            rewards, kl_metrics = self._rewards(rows)
            rows["advantages"], rows["returns"] = compute_advantages(
                a.adv_estimator,
                rewards,
                rows["response_mask"],
                rows["uid"],
                values=rows["values"] if "values" in rows else None,
                baseline_scores=rows["baseline_scores"] if "baseline_scores" in rows else None,
                gamma=a.gamma,
                lam=a.lam,
                norm_by_std=a.norm_adv_by_std,
                eps=a.epsilon,
            )
        critic_metrics = []
        if self.rt.critic is not None:
            with _timer(timing, "critic_update"):
                c = cfg.critic
                critic_metrics = self.rt.critic.update_critic(
                    self._trainer_view(rows, "values", "returns"),
                    c.ppo_mini_batch_size,
                    c.ppo_epochs,
                    cfg.trainer.seed + step,
                )
        with _timer(timing, "update"):
            keys = ["old_log_probs", "advantages", "rollout_log_probs"] + (["ref_log_probs"] if cfg.ref.enabled else [])
            per_rank = self.rt.actor.update_actor(
                self._trainer_view(rows, *keys),
                cfg.actor.ppo_mini_batch_size,
                cfg.actor.ppo_epochs,
                cfg.rollout.temperature,
                cfg.trainer.seed + step,
                parity_atol=cfg.bridge.parity_atol if reuse else None,
            )
        if reuse:
            parity = self._update_parity(per_rank, step)
        if self.release:
            with _timer(timing, "resume"):
                self.rt.fleet.resume_memory(["weights"])
        self._before_sync(timing)
        with _timer(timing, "sync"):
            self.weight_version += 1
            bridge_stats = self.sync_weights()
        if self.release:
            with _timer(timing, "resume_kv"):
                self.rt.fleet.resume_memory(["kv_cache"])
        timing["perf/step_s"] = time.perf_counter() - t_step
        if self.mfu is not None:
            timing.update(self.mfu.metrics(self._token_lengths(rows), timing))
        # engines restarted anywhere in the step: in generation, memory release/resume or the sync
        rollout_stats["rollout/engine_restarts"] = float(self.rt.fleet.restarts - restarts_before)
        return {
            **self._rollout_metrics(rows),
            **rollout_stats,
            **parity,
            **_average(per_rank),
            **timing,
            **kl_metrics,
            **_average(critic_metrics or []),
            **take_counts(),
            **self.scorer.take_metrics(),
            **{k: float(v) for k, v in bridge_stats.items() if k.startswith("bridge/")},
        }

    def _before_sync(self, timing: dict) -> None:
        """Where a loop whose engines generate during the update waits for them (one_step_off)."""

    def sync_weights(self) -> dict:
        """Push the actor's weights to every engine; returns the bridge's stats (rank 0's). An
        engine that died since the rollout makes the push fail (the engines that are alive keep
        their previous weights: a sync is all or nothing): the fleet restarts it (it gets these
        weights through _resync) and the push is repeated for all engines."""
        from megarl.controller.worker_group import WorkerError

        try:
            return self.rt.actor.sync_weights(self._bridge_spec(), str(self.weight_version)) or {}
        except WorkerError:
            if not self.rt.fleet.recover(wait=True):
                raise  # every engine is alive: the failure is not a dead engine's
            return self.rt.actor.sync_weights(self._bridge_spec(), str(self.weight_version)) or {}

    def _resync(self, urls: list[str]) -> None:
        """A restarted engine gets the weights the others serve before it takes requests."""
        self.rt.actor.sync_weights(self._bridge_spec(), str(self.weight_version), urls)

    def validate(self, step: int) -> dict:
        """trainer.val_n samples of every val prompt; val/* metrics per data_source (validation.py)."""
        from megarl.trainer.validation import run_validation

        def generate(prompts: Batch) -> Batch:
            with self._watching_ranks():
                return self.rt.rollout.generate(prompts, self._sampling(step, train=False), self._served_version())

        t = self.cfg.trainer
        metrics = run_validation(self.rt.val_data, generate, self._score, t.val_n, t.val_pass_threshold)
        # validation's model-reward counters: val/reward/..., val/perf/...
        return {**metrics, **{f"val/{k}": v for k, v in self.scorer.take_metrics().items()}}

    # ---------------------------------------------------------------- pieces
    def _next_prompts(self) -> Batch:
        prompts = self._batches.batch_at(self.data_cursor)
        self.data_cursor += 1
        return prompts

    def _generate_scored(self, step: int, prompts: Batch, timing: dict) -> tuple[Batch, dict]:
        """The step's scored rows. With algorithm.filter_groups: only groups whose responses scored
        differently, generating from the next prompt batches until a batch is full
        (dynamic_sampling.py); the rounds' rollout stats add up."""
        f = self.cfg.algorithm.filter_groups
        stats: dict[str, float] = {}

        def generate(k: int) -> Batch:
            batch = prompts if k == 0 else self._next_prompts()
            overlap = self.scorer.start_overlap(batch, self.cfg.rollout.n)  # None: reward.overlap off
            with _timer(timing, "gen"), self._watching_ranks():
                rows = self.rt.rollout.generate(
                    batch,
                    self._sampling(step, train=True, round_=k),
                    self._served_version(),
                    **(overlap.kwargs if overlap else {}),
                )
            for key, value in self.rt.rollout.last_stats.items():
                stats[key] = stats.get(key, 0.0) + float(value)
            with _timer(timing, "reward"):
                rows["raw_scores"] = overlap.collect(rows) if overlap else self._score(rows)
                rows["scores"] = rows["raw_scores"] + self._overlong_penalty(rows)
            return rows

        if not f.enable:
            return generate(0), stats
        every: list[torch.Tensor] = []  # all rounds' scores: the policy's reward before the filter

        def generate_all(k: int) -> Batch:
            rows = generate(k)
            every.append(rows["raw_scores"])
            return rows

        rows, filled = fill_informative(
            generate_all, self.cfg.data.train_batch_size, f.max_num_gen_batches, pad=f.on_exhausted == "pad"
        )
        return rows, {**stats, **filled, "reward/generated_mean": float(torch.cat(every).mean())}

    def _remax_baseline(self, step: int, rows: Batch, timing: dict) -> tuple[torch.Tensor, dict]:
        from dataclasses import replace

        from megarl.trainer.remax import greedy_baselines

        base = self._sampling(step, train=False)  # seeds (seed, step, 2): neither training's nor validation's
        greedy = replace(base, n=1, temperature=0.0, seed=base.seed and (self.cfg.trainer.seed, step, 2))

        def generate(prompts: Batch) -> Batch:
            with _timer(timing, "gen_baseline"), self._watching_ranks():
                return self.rt.rollout.generate(prompts, greedy, self._served_version())

        def score(out: Batch) -> torch.Tensor:
            with _timer(timing, "reward"):
                return self._score(out) + self._overlong_penalty(out)

        return greedy_baselines(rows, generate, score)

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
        every engine loads (labelled "default", or "0" after a restart's resync): not checked."""
        return str(self.weight_version) if self.weight_version else None

    def _watching_ranks(self) -> RankWatch:
        """Generation calls no rank: a rank dying meanwhile aborts it and is raised (rank_watch.py)."""
        # the fleet makes its own clients: the manager's belong to the main thread
        return RankWatch([self.rt.actor, self.rt.critic], lambda: self.rt.fleet.abort_all_requests())

    def _sampling(self, step: int, train: bool, round_: int = 0) -> SamplingSpec:
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

    def _score(self, rows: Batch) -> torch.Tensor:
        return self.scorer.score_batch(rows)

    @staticmethod
    def _token_lengths(rows: Batch) -> list[int]:
        from megarl.engine.megatron.packing import row_lengths  # tool tokens (mask 0) inside count

        return row_lengths(rows["input_ids"], rows["prompt_lengths"], rows["response_mask"]).tolist()

    def _trainer_view(self, rows: Batch, *extra: str) -> Batch:
        """Only the tensors the engine reads travel to the workers."""
        keys = ["input_ids", "prompt_lengths", "responses", "response_mask", *extra]
        keys += ["routed_experts"] if "routed_experts" in rows else []  # actor.moe.routing_replay
        view = Batch({k: rows[k] for k in keys})
        if len(view) % self.dp_size:
            raise ValueError(
                f"{len(view)} rows do not split over {self.dp_size} data-parallel "
                "ranks; make data.train_batch_size * rollout.n divisible by dp"
            )
        return view

    def _check_parity(self, rows: Batch, step: int) -> dict:
        """The server sampled with the weights the trainer just scored with (parity.py)."""
        return check_parity(rows, step, self.cfg.bridge, self.weight_version, lambda: engine_versions(self.rt.fleet))

    def _update_parity(self, per_rank: list[dict], step: int) -> dict:
        """actor.old_log_prob=rollout: the check on the update's first mini-batch (parity.py)."""
        return check_update_parity(
            per_rank, step, self.cfg.bridge, self.weight_version, lambda: engine_versions(self.rt.fleet)
        )

    def _rollout_metrics(self, rows: Batch) -> dict:
        mask = rows["response_mask"]
        lengths = mask.sum(-1)
        out = {
            "reward/mean": float(rows["scores"].mean()),
            "reward/max": float(rows["scores"].max()),
            "reward/min": float(rows["scores"].min()),
            "response/length_mean": float(lengths.mean()),
            "response/clip_ratio": float(np.mean(rows["finish_reason"] == "length")),
        }
        if "entropy" in rows:  # the old-log-prob pass's; else the update's first mini-batch's
            out["rollout/entropy"] = float(masked_mean(rows["entropy"], mask))
        if self.cfg.reward.overlong_buffer.enable:
            out["reward/raw_mean"] = float(rows["raw_scores"].mean())
            out["reward/overlong_penalized_frac"] = float((rows["scores"] < rows["raw_scores"]).float().mean())
        if "advantages" in rows:  # over response tokens: all zero means no gradient from the PG loss
            adv = rows["advantages"][mask.bool()]
            out.update({"adv/mean": float(adv.mean()), "adv/max": float(adv.max()), "adv/min": float(adv.min())})
        if "ref_log_probs" in rows:
            out["actor/kl"] = float(masked_mean(rows["old_log_probs"] - rows["ref_log_probs"], mask))
        return out

    def _bridge_spec(self) -> BridgeSpec:
        b = self.cfg.bridge
        return BridgeSpec(
            transport=b.transport,
            server_urls=tuple(self.rt.server_urls),
            api_key=self.rt.fleet.api_key,
            bucket_bytes=int(b.bucket_size_mb * 2**20),
            disk_dir=str(self.rt.run_dir / "weights"),
            timeout_s=self.cfg.rollout.request_timeout_s,
            # this loop syncs only after generation finished: nothing to pause
            pause_generation=False,
        )


class _timer:
    def __init__(self, out: dict, name: str):
        self.out, self.name = out, name

    def __enter__(self):
        self.t = time.perf_counter()

    def __exit__(self, *exc):  # a phase run several times in a step (generation rounds) adds up
        key = f"perf/{self.name}_s"
        self.out[key] = self.out.get(key, 0.0) + time.perf_counter() - self.t


def _average(dicts: list[dict]) -> dict:
    dicts = [d for d in dicts if d]
    keys = {k for d in dicts for k in d}
    # perf/memory/*: the largest rank's (the one that decides whether a layout fits); the rest: means
    return {
        k: (
            max(d[k] for d in dicts if k in d)
            if k.startswith("perf/memory/")
            else sum(d[k] for d in dicts if k in d) / sum(k in d for d in dicts)
        )
        for k in keys
    }
