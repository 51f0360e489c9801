"""The phases of one RL step, each a short function of the loop and the step's rows.

    rows = generate + score            (the Trainer's rollout source: sources.py)
    rows = release_and_balance(rows)   colocated engines free their memory; rows balanced over DP
    rows = old_ref_values(rows)        old log-probs (or the rollout's), reference log-probs, values
    rows = advantages(rows)            the estimator, with the KL penalty in the reward when enabled
    update(rows)                       critic, then actor (Megatron, distributed optimizer)
    sync()                             engines get their memory back and the new weights

`loop` (a StepLoop: the Trainer, loop.py) owns the runtime, the config and the weight
version; every phase records its seconds in `timing` under perf/<phase>_s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megarl.algo.advantages import compute_advantages
from megarl.algo.sequence_losses import SEQUENCE_LOSSES
from megarl.data.balance import balance_across_ranks, balance_groups_across_ranks
from megarl.data.batch import Batch
from megarl.trainer.step_loop import StepLoop
from megarl.trainer.step_metrics import timer

if TYPE_CHECKING:
    from megarl.config.schema import RunConfig


def release_and_balance(loop: StepLoop, rows: Batch, timing: dict) -> Batch:
    """Colocated engines release weights and KV cache for the training phases; the rows are
    reordered so every data-parallel rank gets a similar number of tokens."""
    if loop.release:
        with timer(timing, "release"):
            loop.rt.fleet.release_memory(["weights", "kv_cache"])
    if loop.cfg.trainer.balance_batch and loop.dp_size > 1:
        if coupled_loss(loop.cfg):  # a group's rows train together: whole groups per rank
            order = balance_groups_across_ranks(loop._token_lengths(rows), list(rows["uid"]), loop.dp_size)
        else:
            order = balance_across_ranks(loop._token_lengths(rows), loop.dp_size)
        rows = rows[order]
    return rows


def coupled_loss(cfg: RunConfig) -> bool:
    """The actor's loss couples the rows of a prompt (spin): they stay on one rank, in one mini-batch."""
    loss = SEQUENCE_LOSSES.get(cfg.actor.policy_loss)
    return loss is not None and loss.coupled


def old_ref_values(loop: StepLoop, rows: Batch, step: int, timing: dict, reuse: bool) -> tuple[Batch, dict]:
    """The old policy's log-probs (the rollout's when `reuse`, checked later against the update's
    first mini-batch; else the actor's, checked against the rollout's now), the reference's and the
    critic's values. Returns the rows and the parity metrics."""
    cfg = loop.cfg
    if reuse:
        rows["old_log_probs"] = rows["rollout_log_probs"].to(torch.float32)
        parity = {}
    else:
        probe = loop._start_probe(rows)  # the engines score the probe rows meanwhile (async loops)
        with timer(timing, "old_log_prob"):
            rows = rows.union(loop.rt.actor.compute_log_prob(loop._trainer_view(rows), cfg.rollout.temperature))
        parity = loop._check_parity(rows, step, probe)
    if cfg.ref.enabled and loop.ref_is_actor and not reuse:
        # the same weights in the same engine and layout as the actor's forward just done: the
        # same log-probs, bit for bit (ref.update_every=1 refreshes it after every update)
        rows["ref_log_probs"] = rows["old_log_probs"].clone()
    elif cfg.ref.enabled:
        with timer(timing, "ref"):
            rows = rows.union(loop.rt.actor.compute_ref_log_prob(loop._trainer_view(rows), cfg.rollout.temperature))
    if loop.rt.critic is not None:  # PPO: the value function's estimate at every response token
        with timer(timing, "values"):
            rows = rows.union(loop.rt.critic.compute_values(loop._trainer_view(rows)))
    return rows, parity


def advantages(loop: StepLoop, rows: Batch, timing: dict, step: int) -> tuple[Batch, dict]:
    """rows["advantages"] and rows["returns"] from the configured estimator (PRIME: with the implicit
    PRM's process rewards, prime.py); the KL-in-reward (and PRM) metrics."""
    metrics = {}
    if loop.rt.prm is not None:
        from megarl.trainer.prime import process_rewards

        rows, metrics = process_rewards(loop, rows, step, timing)
    with timer(timing, "adv"):
        a = loop.cfg.algorithm
        rewards, kl_metrics = loop._rewards(rows)
        rows["advantages"], rows["returns"] = compute_advantages(
            a.adv_estimator,
            rewards,
            rows["response_mask"],
            rows["uid"],
            values=rows["values"] if "values" in rows else None,
            baseline_scores=rows["baseline_scores"] if "baseline_scores" in rows else None,
            process_rewards=rows["process_rewards"] if "process_rewards" in rows else None,
            gamma=a.gamma,
            lam=a.lam,
            norm_by_std=a.norm_adv_by_std,
            eps=a.epsilon,
            sppo_eta=a.sppo.eta,
            bt_scale=a.sppo.bt_scale,
            process_coef=a.prime.process_coef,
            outcome_coef=a.prime.outcome_coef,
        )
    if a.adv_estimator == "sppo":  # its returns are each sample's win probability against the policy
        from megarl.algo.sequence_losses import row_value

        p = row_value(rows["returns"], rows["response_mask"])
        metrics["sppo/win_prob_spread"] = float((p - 0.5).abs().mean())  # 0: the samples all alike
        metrics["sppo/win_prob_max"] = float(p.max())
    return rows, {**metrics, **kl_metrics}


def update(loop: StepLoop, rows: Batch, step: int, timing: dict, reuse: bool) -> tuple[list[dict], list[dict], Batch]:
    """The critic's update (PPO), then the actor's; returns their per-rank metrics and the rows
    the actor trained on (`rows`' own columns, or more rows: SPIN's chosen ones)."""
    cfg, critic_metrics = loop.cfg, []
    if loop.rt.critic is not None:
        with timer(timing, "critic_update"):
            c = cfg.critic
            critic_metrics = loop.rt.critic.update_critic(
                loop._trainer_view(rows, "values", "returns"),
                c.ppo_mini_batch_size,
                c.ppo_epochs,
                cfg.trainer.seed + step,
            )
    batch, mini, extra = _actor_batch(loop, rows, timing)
    with timer(timing, "update"), loop.actor_lock:  # a restarted engine's resync waits (loop._resync)
        per_rank = loop.rt.actor.update_actor(
            batch,
            mini,
            cfg.actor.ppo_epochs,
            cfg.rollout.temperature,
            cfg.trainer.seed + step,
            parity_atol=cfg.bridge.parity_atol if reuse else None,
        )
        loop.actor_version = loop.weight_version + 1
    every = cfg.ref.update_every
    loop.ref_is_actor = bool(every) and step % every == 0
    if loop.ref_is_actor:  # the reference becomes the policy just trained (spin, sppo)
        with timer(timing, "ref_refresh"):
            extra = {**extra, **loop.rt.actor.refresh_ref()}
    return [{**m, **extra} for m in per_rank], critic_metrics, batch


def _actor_batch(loop: StepLoop, rows: Batch, timing: dict) -> tuple[Batch, int, dict]:
    """What the actor trains on, the mini-batch size in its rows, and metrics. SPIN adds each
    prompt's chosen row (spin.py): the mini-batches grow by as many rows as they have prompts."""
    cfg = loop.cfg
    if cfg.actor.policy_loss == "spin":
        from megarl.trainer.spin import spin_update_batch

        batch, extra = spin_update_batch(loop, rows, timing)
        return batch, cfg.actor.ppo_mini_batch_size * len(batch) // len(rows), extra
    keys = ["old_log_probs", "advantages", "rollout_log_probs"] + (["ref_log_probs"] if cfg.ref.enabled else [])
    return loop._trainer_view(rows, *keys), cfg.actor.ppo_mini_batch_size, {}


def sync(loop: StepLoop, timing: dict) -> dict:
    """Engines re-allocate their weights, get the new version through the bridge, then re-allocate
    their KV cache; returns the bridge's stats."""
    if loop.release:
        with timer(timing, "resume"):
            loop.rt.fleet.resume_memory(["weights"])
    loop.source.before_sync(timing)
    with timer(timing, "sync"):
        loop.weight_version += 1
        bridge_stats = loop.sync_weights()
    if loop.release:
        with timer(timing, "resume_kv"):
            loop.rt.fleet.resume_memory(["kv_cache"])
    return bridge_stats
