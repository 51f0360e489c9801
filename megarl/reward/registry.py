"""The reward registry: a verifier per `data_source`, the errors and the counters every verifier shares.

A scorer is fn(solution_str, ground_truth, extra_info) -> float in [0, 1]. A family of data
sources sharing a prefix ("reasoning_gym/<name>") registers a factory that makes the scorer of
each member on first use. The verifiers themselves register here: rule.py (the procedural
tasks), math.py (math-verify), reasoning_gym_score.py (reasoning-gym's own scorers).

Answers a verifier could not judge (a time limit hit, nothing parsable) score 0 and are counted:
`take_counts()` returns the counts since its last call as metrics (`reward/timeouts`, ...), for
the trainer to log with the step's other metrics.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

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


def checked_number(value: object, what: str, unit_interval: bool) -> float:
    """`value` as a float; a RewardError naming `what` unless it is finite (and in [0, 1])."""
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
    return checked_number(value, f"scorer for {data_source!r}", unit_interval=True)
