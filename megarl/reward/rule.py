"""Rule-based reward: a registry of verifiers chosen by each row's `data_source`.

A scorer is fn(solution_str, ground_truth, extra_info) -> float in [0, 1]. A family of data
sources sharing a prefix ("reasoning_gym/<name>") registers a factory that makes the scorer of
each member on first use. A custom reward function ("package.module:function" or
"path/to/file.py:function") has the full signature fn(data_source, solution_str, ground_truth,
extra_info) -> float and replaces the registry.

Answers a verifier could not judge (a time limit hit, nothing parsable) score 0 and are counted:
`take_counts()` returns the counts since its last call as metrics (`reward/timeouts`, ...), for
the trainer to log with the step's other metrics.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

Scorer = Callable[[str, str, dict], float]
RewardFunction = Callable[[str, str, str, dict], float]

_SCORERS: dict[str, Scorer] = {}
_FAMILIES: dict[str, Callable[[str], Scorer]] = {}  # prefix -> factory(data_source) -> scorer
_MEMBERS: dict[str, Scorer] = {}  # family members made so far (a cache, not registrations)

# answers scored 0 because they could not be judged, per kind; always reported, 0 included
COUNTED = ("reward/timeouts", "reward/unparsable", "reward/gold_unparsable", "reward/verifier_errors")
_counts = dict.fromkeys(COUNTED, 0)
_counts_lock = threading.Lock()


class RewardError(ValueError):
    """A reward could not be computed: unknown data_source, bad custom function, bad value."""


def register_scorer(data_source: str) -> Callable[[Scorer], Scorer]:
    """Decorator: make `fn` the verifier of rows whose data_source is `data_source`."""

    def decorate(fn: Scorer) -> Scorer:
        if data_source in _SCORERS and _SCORERS[data_source] is not fn:
            raise RewardError(
                f"data_source {data_source!r} already has a scorer ({_SCORERS[data_source].__qualname__})"
            )
        _SCORERS[data_source] = fn
        return fn

    return decorate


def register_scorer_family(prefix: str, factory: Callable[[str], Scorer]) -> None:
    """Rows whose data_source starts with `prefix` are scored by factory(data_source), made once."""
    if prefix in _FAMILIES and _FAMILIES[prefix] is not factory:
        raise RewardError(f"data_source prefix {prefix!r} already has a scorer family")
    _FAMILIES[prefix] = factory


def known_data_sources() -> list[str]:
    return sorted(_SCORERS) + sorted(f"{prefix}*" for prefix in _FAMILIES)


def count(name: str, n: int = 1) -> None:
    """Add `n` to the counter `name` (one of COUNTED); thread-safe."""
    if name not in _counts:
        raise KeyError(f"unknown reward counter {name!r}; known: {COUNTED}")
    with _counts_lock:
        _counts[name] += n


def take_counts() -> dict[str, float]:
    """The counters since the last call (as float metrics), reset to 0. Counts this process only."""
    with _counts_lock:
        out = {k: float(v) for k, v in _counts.items()}
        for k in _counts:
            _counts[k] = 0
    return out


def _scorer_for(data_source: str) -> Scorer:
    if data_source in _SCORERS:
        return _SCORERS[data_source]
    if data_source in _MEMBERS:
        return _MEMBERS[data_source]
    for prefix, factory in _FAMILIES.items():
        if data_source.startswith(prefix):
            return _MEMBERS.setdefault(data_source, factory(data_source))
    raise RewardError(
        f"no reward rule for data_source {data_source!r}; known data sources: "
        f"{known_data_sources()}. Register one with @register_scorer or set "
        "reward.custom_function"
    )


def _checked(value: object, what: str, unit_interval: bool) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise RewardError(f"{what} returned {value!r}, not a number") from None
    if not math.isfinite(number) or (unit_interval and not 0.0 <= number <= 1.0):
        bound = "in [0, 1]" if unit_interval else "finite"
        raise RewardError(f"{what} returned {number}, which is not {bound}")
    return number


def score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """The registered rule verifier's score for one response, in [0, 1]."""
    value = _scorer_for(data_source)(solution_str, ground_truth, extra_info or {})
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
        return _checked(value, f"reward.custom_function {custom_function!r}", unit_interval=False)

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
            scores.append(_checked(reward_fn(d, s, g, e), "the reward function", unit_interval=False))
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
