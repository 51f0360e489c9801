"""megarl.reward: rule verifiers chosen by data_source, and custom reward functions."""

from megarl.reward.rule import (RewardError, known_data_sources, load_custom_function,
                                make_reward_function, register_scorer, score, score_rows)

__all__ = [
    "RewardError", "known_data_sources", "load_custom_function", "make_reward_function",
    "register_scorer", "score", "score_rows",
]
