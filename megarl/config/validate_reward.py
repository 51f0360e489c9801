"""Validation of the reward: the custom function's form (reward.custom_function) and the model
reward (reward.model.*, megarl/reward/model.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig

# sequence-classification reward models whose head is one `score` linear on the decoder
# (transformers' GenericForSequenceClassification): what megarl/reward/seqcls.py scores
CLASSIFIER_ARCHITECTURES = frozenset(
    {
        "LlamaForSequenceClassification",
        "Qwen2ForSequenceClassification",
        "Qwen3ForSequenceClassification",
        "Qwen3MoeForSequenceClassification",
    }
)
# reward models megarl builds in code (megarl/reward/rm_presets.py holds their recipes)
REWARD_MODEL_PRESETS = ("tiny-digits-rm",)
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
    _require(
        m.preset is None or m.kind == "classifier",
        "reward.model.preset",
        f"reward.model.preset={m.preset!r} builds a classifier reward model; set reward.model.kind=classifier",
    )
    if m.kind == "none":
        return
    for key in ("batch_size", "concurrency", "timeout_s", "max_new_tokens"):
        _require(getattr(m, key) > 0, f"reward.model.{key}", f"reward.model.{key}={getattr(m, key)!r} must be > 0")
    _require(m.max_retries >= 0, "reward.model.max_retries", f"reward.model.max_retries={m.max_retries} must be >= 0")
    url_ok = m.url is None or bool(re.match(r"^https?://[^/\s]+", m.url))
    _require(url_ok, "reward.model.url", f"reward.model.url={m.url!r} must be an http:// or https:// URL")
    if m.kind == "classifier":
        check_classifier(cfg)
        return
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


def check_classifier(cfg: RunConfig) -> None:
    """kind=classifier: one reward model (a folder with a one-score head, or a preset) and where
    its ranks go."""
    m = cfg.reward.model
    _require(
        (m.path is None) != (m.preset is None),
        "reward.model.path",
        "reward.model.kind=classifier needs exactly one of reward.model.path (a reward model's Hugging Face "
        "folder, e.g. from `python -m megarl.reward.train_rm`) and reward.model.preset (one built in code: "
        f"{', '.join(REWARD_MODEL_PRESETS)})",
    )
    _require(
        m.preset is None or m.preset in REWARD_MODEL_PRESETS,
        "reward.model.preset",
        f"reward.model.preset={m.preset!r} is not a reward model preset; choose one of {list(REWARD_MODEL_PRESETS)}",
    )
    if m.path is not None:
        check_classifier_head(m.path)
    if m.num_workers is not None:
        limit = cfg.cluster.num_actor_ranks if m.placement == "colocated" else None
        _require(
            m.num_workers >= 1 and (limit is None or m.num_workers <= limit),
            "reward.model.num_workers",
            f"reward.model.num_workers={m.num_workers} must be >= 1"
            + (f" and, colocated, at most cluster.num_actor_ranks={limit} (one per actor device)" if limit else ""),
        )


def check_classifier_head(path: str) -> None:
    """reward.model.path is a Hugging Face folder of a supported XForSequenceClassification whose
    head gives one score per sequence (num_labels=1)."""
    key, config_file = "reward.model.path", Path(path) / "config.json"
    _require(Path(path).is_dir(), key, f"reward.model.path={path!r} does not exist")
    _require(
        config_file.is_file(),
        key,
        f"reward.model.path={path!r} is not a Hugging Face checkpoint directory (no config.json)",
    )
    config = json.loads(config_file.read_text())
    archs = list(config.get("architectures") or [])
    train_hint = "train one with `python -m megarl.reward.train_rm --init FOLDER --pairs PAIRS.jsonl --out DIR`"
    _require(
        any(a in CLASSIFIER_ARCHITECTURES for a in archs),
        key,
        f"reward.model.path={path!r} has no sequence-classification head we can score ({archs or 'no architectures'}); "
        f"a reward model is one of {sorted(CLASSIFIER_ARCHITECTURES)} with num_labels=1: {train_hint}",
    )
    labels = len(config["id2label"]) if config.get("id2label") else int(config.get("num_labels", 2))
    _require(
        labels == 1,
        key,
        f"reward.model.path={path!r}: its head gives {labels} scores per sequence (num_labels={labels}); "
        f"a reward model gives one (num_labels=1): {train_hint}",
    )


def resolve_reward(cfg: RunConfig) -> None:
    """reward.overlap auto (None): on exactly when there is a model reward, whose scoring is slow.
    reward.model.normalize auto: running for a classifier, none otherwise."""
    if cfg.reward.overlap is None:
        cfg.reward.overlap = cfg.reward.model.kind != "none"
    if cfg.reward.model.normalize is None:
        cfg.reward.model.normalize = default_normalize(cfg.reward.model.kind)


def default_normalize(kind: str) -> str:
    """reward.model.normalize's auto (reward/normalize.py says why)."""
    return "running" if kind == "classifier" else "none"
