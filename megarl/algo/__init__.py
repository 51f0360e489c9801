"""megarl.algo: RL algorithm math as pure torch functions (no Ray, no Megatron)."""

from megarl.algo.advantages import (ESTIMATORS, compute_advantages, grpo_advantages,
                                    group_normalized_scores, register_estimator, row_scores)
from megarl.algo.kl import KL_KINDS, kl_loss, kl_penalty
from megarl.algo.losses import (LOSS_AGG_MODES, agg_loss, entropy_from_logits, entropy_loss,
                                masked_mean, policy_loss)

__all__ = [
    "ESTIMATORS", "KL_KINDS", "compute_advantages", "register_estimator", "LOSS_AGG_MODES", "agg_loss", "entropy_from_logits", "entropy_loss",
    "group_normalized_scores", "grpo_advantages", "kl_loss", "kl_penalty", "masked_mean",
    "policy_loss", "row_scores",
]
