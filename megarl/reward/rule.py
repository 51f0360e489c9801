"""The procedural tasks' rule verifiers, and the run's reward function built on the registry.

The rule verifiers score the rows of megarl.data.tasks by data_source ("megarl/digits",
"megarl/arith", "megarl/arith_tool"); they register themselves in registry.py. A custom reward
function ("package.module:function" or "path/to/file.py:function") has the full signature
fn(data_source, solution_str, ground_truth, extra_info) -> float and replaces the registry.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Sequence
from pathlib import Path

from megarl.reward.registry import RewardError, RewardFunction, checked_number, register_scorer, score


def load_custom_function(spec: str) -> RewardFunction:
    """Import `spec` = "package.module:function" or "path/to/file.py:function"."""
    module_name, sep, fn_name = spec.rpartition(":")
    if not sep or not module_name or not fn_name:
        raise RewardError(f"reward.custom_function={spec!r} must look like 'package.module:function'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            if module_spec is None or not path.is_file():
                raise FileNotFoundError(path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(module_name)
    except (ImportError, FileNotFoundError) as e:
        raise RewardError(f"reward.custom_function={spec!r}: cannot import {module_name!r} ({e})") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardError(f"reward.custom_function={spec!r}: {module_name!r} has no function {fn_name!r}")
    return fn


def make_reward_function(
    custom_function: str | None = None, *, math_timeout_s: float | None = None, math_workers: int | None = None
) -> RewardFunction:
    """The run's reward: the custom function if configured, else the rule registry.

    math_timeout_s / math_workers (reward.math_timeout_s / reward.math_workers) set this process's
    math verifier (megarl.reward.math.configure); None keeps its defaults.
    """
    if math_timeout_s is not None or math_workers is not None:
        from megarl.reward.math import configure

        configure(timeout_s=math_timeout_s, max_workers=math_workers)
    if custom_function is None:
        return score
    fn = load_custom_function(custom_function)

    def custom(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
        value = fn(data_source, solution_str, ground_truth, extra_info or {})
        return checked_number(value, f"reward.custom_function {custom_function!r}", unit_interval=False)

    return custom


def score_rows(
    reward_fn: RewardFunction,
    data_sources: Sequence[str],
    solutions: Sequence[str],
    ground_truths: Sequence[str],
    extra_infos: Sequence[dict | None],
    row_ids: Sequence[int] | None = None,
) -> list[float]:
    """reward_fn applied row by row (the columns must be equally long).

    A reward that raises or returns something other than a number is re-raised as a RewardError
    naming the row (its index in these columns, or its entry of `row_ids`: the rows' numbers in
    the step's batch when these columns are a part of it), its data_source and its ground truth.
    """
    lengths = {len(data_sources), len(solutions), len(ground_truths), len(extra_infos)}
    if row_ids is not None:
        lengths.add(len(row_ids))
    if len(lengths) != 1:
        raise RewardError(f"score_rows got columns of different lengths {sorted(lengths)}")
    scores = []
    for k, (d, s, g, e) in enumerate(zip(data_sources, solutions, ground_truths, extra_infos)):
        row = k if row_ids is None else row_ids[k]
        try:
            scores.append(checked_number(reward_fn(d, s, g, e), "the reward function", unit_interval=False))
        except Exception as exc:
            where = f"row {row} (data_source {d!r}, ground_truth {_short(g)})"
            if isinstance(exc, RewardError):
                raise RewardError(f"{where}: {exc}") from exc
            raise RewardError(f"{where}: the reward raised {type(exc).__name__}: {exc}") from exc
    return scores


def _short(text: object, limit: int = 60) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[:limit] + "...'"


# ------------------------------------------------------------------ built-in verifiers
@register_scorer("megarl/digits")
def digits_score(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    """Fraction of the answer's characters the response gets right, position by position.

    The answer is read from the first len(ground_truth) characters of the response; anything
    after them is ignored (a model trained from scratch rarely learns to stop, and
    rollout.max_new_tokens bounds the length anyway).
    """
    if not ground_truth:
        raise RewardError("megarl/digits row has an empty ground_truth")
    hits = sum(a == b for a, b in zip(solution_str, ground_truth))
    return hits / len(ground_truth)


@register_scorer("megarl/shapes")
def shapes_score(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    """1 when the response, leading spaces stripped, starts with the colour's letter, else 0."""
    if not ground_truth:
        raise RewardError("megarl/shapes row has an empty ground_truth")
    return float(solution_str.lstrip().startswith(ground_truth))


_INTEGER = re.compile(r"-?\d[\d,]*")


@register_scorer("megarl/arith")
def arith_score(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    """1 when the last integer in the response (thousands commas allowed) is the answer, else 0."""
    found = _INTEGER.findall(solution_str)
    return float(bool(found) and found[-1].replace(",", "") == ground_truth.strip())


@register_scorer("megarl/arith_tool")
def arith_tool_score(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    """The agent example's reward (data.task arith_tool): 1 for the answer as the last integer of
    the model's last turn (arith's rule), 0.1 for another integer there (a shaping term, so a
    random-init model's rewards differ within a group and GRPO has a gradient), else 0."""
    if arith_score(solution_str, ground_truth, extra_info):
        return 1.0
    return 0.1 if _INTEGER.search(solution_str) else 0.0
