"""megarl.algo: RL algorithm math as pure torch functions (no Ray, no Megatron)."""

from megarl.algo.advantages import (ESTIMATORS, compute_advantages, grpo_advantages,
                                    group_normalized_scores, register_estimator, row_scores)
from megarl.algo.corrections import ROLLOUT_IS_LEVELS, mismatch_metrics, rollout_is_weights
from megarl.algo.kl import (KL_CONTROLLERS, KL_KINDS, AdaptiveKLController, FixedKLController,
                            apply_kl_penalty, kl_loss, kl_penalty, make_kl_controller,
                            token_level_scores)
from megarl.algo.losses import (LOSS_AGG_MODES, POLICY_LOSSES, PolicyLossConfig, agg_loss,
                                entropy_from_logits, entropy_loss, get_policy_loss, masked_mean,
                                policy_loss, register_policy_loss)

__all__ = [
    "ESTIMATORS", "KL_CONTROLLERS", "KL_KINDS", "LOSS_AGG_MODES", "POLICY_LOSSES", "ROLLOUT_IS_LEVELS",
    "AdaptiveKLController", "FixedKLController", "PolicyLossConfig", "agg_loss", "apply_kl_penalty",
    "compute_advantages", "entropy_from_logits", "entropy_loss", "get_policy_loss",
    "group_normalized_scores", "grpo_advantages", "kl_loss", "kl_penalty", "make_kl_controller",
    "masked_mean", "mismatch_metrics", "policy_loss", "register_estimator", "register_policy_loss",
    "rollout_is_weights", "row_scores", "token_level_scores",
]
