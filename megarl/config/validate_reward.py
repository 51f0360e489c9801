"""Validation of the reward: the custom function's form (reward.custom_function) and the model
reward (reward.model.*, megarl/reward/model.py)."""

from __future__ import annotations

import re
from pathlib import Path

from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig

_FUNCTION_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def check_reward_function(cfg: RunConfig) -> None:
    """reward.custom_function: 'package.module:function', or 'path/to/file.py:function' of a file
    that exists; the function itself is imported when the reward is made."""
    fn = cfg.reward.custom_function
    if fn is not None and ".py:" in fn:
        path = fn.rpartition(":")[0]
        _require(
            Path(path).is_file(), "reward.custom_function", f"reward.custom_function={fn!r}: file {path} does not exist"
        )
    else:
        _require(
            fn is None or bool(_FUNCTION_REF.match(fn)),
            "reward.custom_function",
            f"reward.custom_function={fn!r} must look like 'package.module:function' or 'path/to/file.py:function'",
        )


def check_reward_model(cfg: RunConfig) -> None:
    m = cfg.reward.model
    if m.kind == "none":
        return
    for key in ("batch_size", "concurrency", "timeout_s", "max_new_tokens"):
        _require(getattr(m, key) > 0, f"reward.model.{key}", f"reward.model.{key}={getattr(m, key)!r} must be > 0")
    _require(m.max_retries >= 0, "reward.model.max_retries", f"reward.model.max_retries={m.max_retries} must be >= 0")
    url_ok = m.url is None or bool(re.match(r"^https?://[^/\s]+", m.url))
    _require(url_ok, "reward.model.url", f"reward.model.url={m.url!r} must be an http:// or https:// URL")
    if m.kind == "remote":
        _require(
            m.url is not None,
            "reward.model.url",
            "reward.model.kind=remote needs reward.model.url, the scoring endpoint (e.g. "
            "http://127.0.0.1:8000/score from `python -m megarl.reward.serve --port 8000`)",
        )
        return
    # genrm
    _require(
        m.url is not None or m.path is not None,
        "reward.model.path",
        "reward.model.kind=genrm needs a judge: reward.model.url (an SGLang-API server) or "
        "reward.model.path (a Hugging Face folder; an embedded judge server is started on it)",
    )
    if m.path is not None:
        _require(
            (Path(m.path) / "config.json").is_file(),
            "reward.model.path",
            f"reward.model.path={m.path!r} is not a Hugging Face checkpoint directory (no config.json)",
        )
    try:
        re.compile(m.score_pattern)
    except re.error as err:
        raise ConfigError(
            "reward.model.score_pattern",
            f"reward.model.score_pattern={m.score_pattern!r} is not a regular expression: {err}",
        ) from None
    _require(
        m.score_min < m.score_max,
        "reward.model.score_min",
        f"reward.model.score_min={m.score_min} must be < reward.model.score_max={m.score_max}",
    )
    _require(
        m.prompt_template is None or "{response}" in m.prompt_template,
        "reward.model.prompt_template",
        "reward.model.prompt_template has no {response}: the judge would never see the response "
        "it grades ({prompt} and {ground_truth} are optional)",
    )


def resolve_reward(cfg: RunConfig) -> None:
    """reward.overlap auto (None): on exactly when there is a model reward, whose scoring is slow."""
    if cfg.reward.overlap is None:
        cfg.reward.overlap = cfg.reward.model.kind != "none"
