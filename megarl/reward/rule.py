"""Rule-based reward: a registry of verifiers chosen by each row's `data_source`.

A scorer is fn(solution_str, ground_truth, extra_info) -> float in [0, 1]. A custom reward
function ("package.module:function" or "path/to/file.py:function") has the full signature
fn(data_source, solution_str, ground_truth, extra_info) -> float and replaces the registry.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path

Scorer = Callable[[str, str, dict], float]
RewardFunction = Callable[[str, str, str, dict], float]

_SCORERS: dict[str, Scorer] = {}


class RewardError(ValueError):
    """A reward could not be computed: unknown data_source, bad custom function, bad value."""


def register_scorer(data_source: str) -> Callable[[Scorer], Scorer]:
    """Decorator: make `fn` the verifier of rows whose data_source is `data_source`."""
    def decorate(fn: Scorer) -> Scorer:
        if data_source in _SCORERS and _SCORERS[data_source] is not fn:
            raise RewardError(f"data_source {data_source!r} already has a scorer "
                              f"({_SCORERS[data_source].__qualname__})")
        _SCORERS[data_source] = fn
        return fn
    return decorate


def known_data_sources() -> list[str]:
    return sorted(_SCORERS)


def _checked(value: object, what: str, unit_interval: bool) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise RewardError(f"{what} returned {value!r}, not a number") from None
    if not math.isfinite(number) or (unit_interval and not 0.0 <= number <= 1.0):
        bound = "in [0, 1]" if unit_interval else "finite"
        raise RewardError(f"{what} returned {number}, which is not {bound}")
    return number


def score(data_source: str, solution_str: str, ground_truth: str,
          extra_info: dict | None = None) -> float:
    """The registered rule verifier's score for one response, in [0, 1]."""
    if data_source not in _SCORERS:
        raise RewardError(f"no reward rule for data_source {data_source!r}; known data sources: "
                          f"{known_data_sources()}. Register one with @register_scorer or set "
                          "reward.custom_function")
    value = _SCORERS[data_source](solution_str, ground_truth, extra_info or {})
    return _checked(value, f"scorer for {data_source!r}", unit_interval=True)


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
        raise RewardError(f"reward.custom_function={spec!r}: {module_name!r} has no function "
                          f"{fn_name!r}")
    return fn


def make_reward_function(custom_function: str | None = None) -> RewardFunction:
    """The run's reward: the custom function if configured, else the rule registry."""
    if custom_function is None:
        return score
    fn = load_custom_function(custom_function)

    def custom(data_source: str, solution_str: str, ground_truth: str,
               extra_info: dict | None = None) -> float:
        value = fn(data_source, solution_str, ground_truth, extra_info or {})
        return _checked(value, f"reward.custom_function {custom_function!r}", unit_interval=False)
    return custom


def score_rows(reward_fn: RewardFunction, data_sources: Sequence[str], solutions: Sequence[str],
               ground_truths: Sequence[str], extra_infos: Sequence[dict | None]) -> list[float]:
    """reward_fn applied row by row (the columns must be equally long)."""
    lengths = {len(data_sources), len(solutions), len(ground_truths), len(extra_infos)}
    if len(lengths) != 1:
        raise RewardError(f"score_rows got columns of different lengths {sorted(lengths)}")
    return [reward_fn(d, s, g, e) for d, s, g, e in zip(data_sources, solutions, ground_truths,
                                                          extra_infos)]


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


_INTEGER = re.compile(r"-?\d[\d,]*")


@register_scorer("megarl/arith")
def arith_score(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    """1 when the last integer in the response (thousands commas allowed) is the answer, else 0."""
    found = _INTEGER.findall(solution_str)
    return float(bool(found) and found[-1].replace(",", "") == ground_truth.strip())
