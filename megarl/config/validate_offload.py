"""actor.offload / critic.offload: what Megatron's host optimizer (host_optimizer, the share of
Adam's state and step kept and run on the host) can run with.

Megatron's HybridDeviceOptimizer goes with its precision-aware distributed optimizer (Megatron-LM
refuses the one without the other): the hybrid optimizer then holds the fp32 master weights of
16-bit parameters itself, on the host for its share. Megatron-core 0.19.2 accepts neither the
precision-aware optimizer without the distributed one ("only supported with distributed
optimizer") nor fp32 parameters under the hybrid one (the distributed optimizer hands it views of
fp32 weights: "can't optimize a non-leaf Tensor").
"""

from __future__ import annotations

from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def check_offload(cfg: RunConfig) -> None:
    key = "actor.offload.host_optimizer"
    share = cfg.actor.offload.host_optimizer
    _require(
        0 <= share <= 1,
        key,
        f"{key}={share!r} must be in [0, 1]: the share of the optimizer's state and step kept on "
        "the host (0: all on the device, 1: CPU Adam for every parameter)",
    )
    if share > 0:
        _require(
            cfg.actor.optim.use_distributed_optimizer,
            key,
            f"{key}={share} needs actor.optim.use_distributed_optimizer=true: Megatron's host "
            "optimizer runs inside its (precision-aware) distributed optimizer",
        )
        _require(
            cfg.actor.precision == "bf16",
            key,
            f"{key}={share} needs actor.precision=bf16 (it is {cfg.actor.precision}): Megatron's host "
            "optimizer keeps the fp32 master weights of bf16 parameters and cannot take fp32 ones",
        )
    critic = cfg.critic.offload.host_optimizer
    _require(
        critic == 0,
        "critic.offload.host_optimizer",
        f"critic.offload.host_optimizer={critic!r}: the critic trains in fp32, which Megatron's host "
        "optimizer cannot take; set it to 0 (critic.offload.optimizer=true moves its state off the "
        "device between updates instead)",
    )
