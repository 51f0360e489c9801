"""reasoning-gym's own scorers, for rows whose data_source is "reasoning_gym/<dataset name>".

The rows come from megarl.data.tasks (data.task=rg:<name>), which keeps the generated entry
(question, answer, metadata) as JSON in extra_info["rg_entry"]: many datasets score from the
metadata (countdown checks the numbers used and the target), not from the answer string alone.
The response's answer is the text of its last <answer>...</answer> (reasoning-gym's convention,
reasoning_gym.utils.extract_answer) or, without one, the whole response, stripped. The dataset's
score_answer(answer, entry) gives the score, in [0, 1] (partial credit where the dataset gives
it: basic_arithmetic gives len(answer)/len(response) when the response contains the answer).
The scorer is reasoning-gym's dataset class with its default configuration.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from megarl.reward.rule import RewardError, Scorer, register_scorer_family

PREFIX = "reasoning_gym/"


def response_answer(solution_str: str) -> str:
    """The answer a response gives: its last <answer> tag's text, else all of it (stripped)."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(solution_str)
    return tagged if tagged is not None else solution_str.strip()


_TAG = "__rg_type__"


def _tagged(value):
    """JSON-able form of an entry: tuples and sets tagged so they come back as themselves (ARC's
    scorers compare parsed boards with the tuples of tuples in the metadata)."""
    if isinstance(value, dict):
        return {k: _tagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tagged(v) for v in value]
    if isinstance(value, (tuple, set, frozenset)):
        return {_TAG: type(value).__name__, "items": [_tagged(v) for v in value]}
    return value


def _untagged(value):
    if isinstance(value, dict):
        if _TAG in value:
            kind = {"tuple": tuple, "set": set, "frozenset": frozenset}[value[_TAG]]
            return kind(_untagged(v) for v in value["items"])
        return {k: _untagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_untagged(v) for v in value]
    return value


def encode_entry(entry: dict) -> str:
    """A generated entry as JSON that decode_entry turns back into an equal entry."""
    return json.dumps(_tagged(entry))


def decode_entry(text: str) -> dict:
    return _untagged(json.loads(text))


def entry_of(extra_info: dict, data_source: str) -> dict:
    """The reasoning-gym entry kept with the row (encode_entry's JSON)."""
    entry = extra_info.get("rg_entry")
    if isinstance(entry, str):
        entry = decode_entry(entry)
    if not isinstance(entry, dict) or "answer" not in entry:
        raise RewardError(
            f"a {data_source} row needs extra_info['rg_entry'], the generated entry "
            f"as JSON (got {type(entry).__name__}); make the rows with "
            "megarl.data.tasks.make_reasoning_gym_rows or data.task=rg:<name>"
        )
    return entry


def make_scorer(data_source: str) -> Scorer:
    """The scorer of data_source "reasoning_gym/<name>": the dataset's score_answer."""
    import reasoning_gym

    name = data_source[len(PREFIX) :]
    if name not in reasoning_gym.factory.DATASETS:
        raise RewardError(
            f"data_source {data_source!r}: reasoning-gym has no dataset {name!r}; "
            f"known: {sorted(reasoning_gym.factory.DATASETS)}"
        )
    score_answer: Callable = reasoning_gym.get_score_answer_fn(name)

    def scorer(solution_str: str, ground_truth: str, extra_info: dict) -> float:
        return float(score_answer(response_answer(solution_str), entry_of(extra_info, data_source)))

    scorer.__qualname__ = f"reasoning_gym[{name}].score_answer"
    return scorer


register_scorer_family(PREFIX, make_scorer)
