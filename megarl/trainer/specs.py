"""What the run's Megatron worker groups are built with, from the config: the actor's engine and
loss, the critic's and the PRM's engines."""

from __future__ import annotations

from megarl.algo.losses import PolicyLossConfig
from megarl.algo.sequence_losses import SequenceLossConfig
from megarl.config.schema import RunConfig
from megarl.engine.megatron.actor import ActorLossSpec
from megarl.engine.megatron.critic import CriticLossSpec
from megarl.engine.megatron.engine import EngineSpec
from megarl.engine.megatron.lora import LoraSpec


def engine_spec(cfg: RunConfig, model_path: str) -> EngineSpec:
    return EngineSpec(
        model_path=model_path,
        parallel=cfg.actor.parallel,
        optim=cfg.actor.optim,
        micro_batch_size=cfg.actor.micro_batch_size,
        seed=cfg.actor.seed,
        moe_dispatcher=cfg.actor.moe.dispatcher,
        pack_sequences=cfg.actor.pack_sequences,
        max_tokens_per_micro_batch=cfg.actor.max_tokens_per_micro_batch,
        precision=cfg.actor.precision,
        recompute=cfg.actor.recompute,
        routing_replay=cfg.actor.moe.routing_replay,
        host_optimizer=cfg.actor.offload.host_optimizer,
        logits_memory=cfg.actor.logits_memory,
        lora=lora_spec(cfg.actor.lora),
    )


def lora_spec(lora) -> LoraSpec | None:
    """actor.lora as the engine's LoRA spec; None when off (rank 0)."""
    if lora.rank == 0:
        return None
    return LoraSpec(rank=lora.rank, alpha=lora.alpha, target_modules=tuple(lora.target_modules), dropout=lora.dropout)


def critic_engine_spec(cfg: RunConfig, model_path: str) -> EngineSpec:
    """The value model starts from critic.model.path, else from the actor's checkpoint."""
    c = cfg.critic
    return EngineSpec(
        model_path=c.model.path or model_path,
        parallel=c.parallel,
        optim=c.optim,
        micro_batch_size=c.micro_batch_size,
        seed=c.seed,
        moe_dispatcher=cfg.actor.moe.dispatcher,
        value_head=True,
        recompute=c.recompute,
    )


def prm_engine_spec(cfg: RunConfig, model_path: str) -> EngineSpec:
    """PRIME's implicit PRM starts from prm.model.path, else from the policy's checkpoint."""
    p = cfg.prm
    return EngineSpec(
        model_path=p.model.path or model_path,
        parallel=p.parallel,
        optim=p.optim,
        micro_batch_size=p.micro_batch_size,
        seed=p.seed,
        moe_dispatcher=cfg.actor.moe.dispatcher,
        pack_sequences=cfg.actor.pack_sequences,
        recompute=p.recompute,
    )


def critic_loss_spec(cfg: RunConfig) -> CriticLossSpec:
    return CriticLossSpec(cliprange_value=cfg.critic.cliprange_value, loss_agg_mode=cfg.critic.loss_agg_mode)


def loss_spec(cfg: RunConfig) -> ActorLossSpec:
    a = cfg.actor
    policy = PolicyLossConfig(
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        gspo_clip_ratio_low=a.gspo_clip_ratio_low,
        gspo_clip_ratio_high=a.gspo_clip_ratio_high,
        cispo_clip_ratio_low=a.cispo_clip_ratio_low,
        cispo_clip_ratio_high=a.cispo_clip_ratio_high,
    )
    return ActorLossSpec(
        policy_loss=a.policy_loss,
        policy=policy,
        sequence=SequenceLossConfig(spin_beta=cfg.algorithm.spin.beta),
        rollout_is_level=a.rollout_is.level,
        rollout_is_threshold=a.rollout_is.threshold,
        loss_agg_mode=a.loss_agg_mode,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        entropy_coeff=a.entropy_coeff,
    )
