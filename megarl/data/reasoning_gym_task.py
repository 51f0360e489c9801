"""A reasoning-gym task, whole: its rows (data.task=rg:<name>) and its scorer (data_source
"reasoning_gym/<name>"), in one place so the two cannot drift apart.

Rows: any reasoning-gym dataset (rg:basic_arithmetic, rg:chain_sum, rg:countdown, ...), generated
by reasoning_gym.create_dataset(name, seed=seed, size=num) with its default configuration. The
prompt is the entry's question as the user message; the ground truth its answer; extra_info keeps
the whole entry (question, answer, metadata) as JSON in "rg_entry": many datasets score from the
metadata (countdown checks the numbers used and the target), not from the answer string alone.

Scorer: the response's answer is the text of its last <answer>...</answer> (reasoning-gym's
convention, reasoning_gym.utils.extract_answer) or, without one, the whole response, stripped.
The dataset's score_answer(answer, entry) gives the score, in [0, 1] (partial credit where the
dataset gives it: basic_arithmetic gives len(answer)/len(response) when the response contains the
answer). The reward registry finds it by data_source: megarl/reward/reasoning_gym_score.py
registers make_scorer for the prefix DATA_SOURCE_PREFIX.
"""

from __future__ import annotations

import json
from collections.abc import Callable

TASK_PREFIX = "rg:"  # data.task=rg:<name>
DATA_SOURCE_PREFIX = "reasoning_gym/"  # the rows' data_source: reasoning_gym/<name>


def make_reasoning_gym_rows(name: str, num: int, seed: int = 0) -> list[dict]:
    """`num` rows of the reasoning-gym dataset `name`, deterministic in `seed`."""
    import reasoning_gym

    if name not in reasoning_gym.factory.DATASETS:
        raise ValueError(f"reasoning-gym has no dataset {name!r}; known: {sorted(reasoning_gym.factory.DATASETS)}")
    if num < 1:
        raise ValueError(f"make_reasoning_gym_rows needs num >= 1, got {num}")
    try:
        dataset = reasoning_gym.create_dataset(name, seed=seed, size=num)
    except (AssertionError, ValueError, TypeError) as err:
        raise ValueError(
            f"reasoning-gym cannot make {name!r} with its default configuration ({type(err).__name__}: {err})"
        ) from err
    rows = []
    for index in range(num):
        entry = dataset[index]
        rows.append(
            {
                "prompt": [{"role": "user", "content": entry["question"]}],
                "data_source": f"{DATA_SOURCE_PREFIX}{name}",
                # no single answer (graph_color, rush_hour, ...: the scorer checks the solution): ""
                "reward_model": {
                    "ground_truth": "" if entry["answer"] is None else str(entry["answer"]),
                    "style": "rule",
                },
                # JSON: entries' metadata differ in shape across rows (one parquet struct would not do)
                "extra_info": {"index": index, "rg_entry": encode_entry(entry)},
            }
        )
    return rows


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


def response_answer(solution_str: str) -> str:
    """The answer a response gives: its last <answer> tag's text, else all of it (stripped)."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(solution_str)
    return tagged if tagged is not None else solution_str.strip()


def entry_of(extra_info: dict, data_source: str, error: type[Exception] = ValueError) -> dict:
    """The reasoning-gym entry kept with the row (encode_entry's JSON); `error` says why not."""
    entry = extra_info.get("rg_entry")
    if isinstance(entry, str):
        entry = decode_entry(entry)
    if not isinstance(entry, dict) or "answer" not in entry:
        raise error(
            f"a {data_source} row needs extra_info['rg_entry'], the generated entry "
            f"as JSON (got {type(entry).__name__}); make the rows with "
            "megarl.data.tasks.make_reasoning_gym_rows or data.task=rg:<name>"
        )
    return entry


def make_scorer(data_source: str, error: type[Exception] = ValueError) -> Callable[[str, str, dict], float]:
    """The scorer of data_source "reasoning_gym/<name>": the dataset's score_answer. A data source
    reasoning-gym does not know, or a row without its entry, raises `error` (the reward registry
    passes its RewardError)."""
    import reasoning_gym

    name = data_source[len(DATA_SOURCE_PREFIX) :]
    if name not in reasoning_gym.factory.DATASETS:
        raise error(
            f"data_source {data_source!r}: reasoning-gym has no dataset {name!r}; "
            f"known: {sorted(reasoning_gym.factory.DATASETS)}"
        )
    score_answer: Callable = reasoning_gym.get_score_answer_fn(name)

    def scorer(solution_str: str, ground_truth: str, extra_info: dict) -> float:
        return float(score_answer(response_answer(solution_str), entry_of(extra_info, data_source, error)))

    scorer.__qualname__ = f"reasoning_gym[{name}].score_answer"
    return scorer
