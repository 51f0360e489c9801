"""megarl.reward: verifiers chosen by data_source (rules, math-verify, reasoning-gym) and custom
reward functions."""

from megarl.reward import math as _math  # noqa: E402,F401  (registers the math data sources)
from megarl.reward import reasoning_gym_score as _rg  # noqa: E402,F401  (reasoning_gym/*)
from megarl.reward.registry import (
    COUNTED,
    RewardError,
    count,
    known_data_sources,
    register_scorer,
    register_scorer_family,
    score,
    take_counts,
)
from megarl.reward.rule import load_custom_function, make_reward_function, score_rows

__all__ = [
    "COUNTED",
    "RewardError",
    "count",
    "known_data_sources",
    "load_custom_function",
    "make_reward_function",
    "register_scorer",
    "register_scorer_family",
    "score",
    "score_rows",
    "take_counts",
]
