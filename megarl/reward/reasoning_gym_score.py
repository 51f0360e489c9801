"""reasoning-gym's own scorers, for rows whose data_source is "reasoning_gym/<dataset name>".

The task, its rows (data.task=rg:<name>) and its scorer together, is megarl.data.reasoning_gym_task;
here its scorer joins the reward registry as a family of data sources, each member made on first
use, raising RewardError like every registered verifier.
"""

from __future__ import annotations

from megarl.data.reasoning_gym_task import DATA_SOURCE_PREFIX
from megarl.data.reasoning_gym_task import make_scorer as _task_scorer
from megarl.reward.registry import RewardError, Scorer, register_scorer_family

PREFIX = DATA_SOURCE_PREFIX


def make_scorer(data_source: str) -> Scorer:
    """The scorer of data_source "reasoning_gym/<name>": the dataset's score_answer."""
    return _task_scorer(data_source, error=RewardError)


register_scorer_family(PREFIX, make_scorer)
