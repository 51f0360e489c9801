"""The model's checkpoints: model.path and critic.model.path are Hugging Face folders, and a depth
override applies only to a tiny preset built from scratch."""

from __future__ import annotations

import json
from pathlib import Path

from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def check_model_paths(cfg: RunConfig) -> None:
    _require(
        cfg.model.path is None or cfg.model.num_hidden_layers is None,
        "model.num_hidden_layers",
        f"model.num_hidden_layers={cfg.model.num_hidden_layers} overrides a preset's depth, but "
        f"model.path={cfg.model.path!r} is set (its config.json decides); remove one of them",
    )
    _require(
        cfg.model.num_hidden_layers is None or cfg.model.preset.startswith("tiny-"),
        "model.num_hidden_layers",
        f"model.num_hidden_layers overrides the depth of a tiny preset built from scratch; "
        f"model.preset={cfg.model.preset!r} is pretrained, so its depth is fixed; remove it",
    )
    _require(
        cfg.model.num_hidden_layers is None or cfg.model.num_hidden_layers >= 1,
        "model.num_hidden_layers",
        f"model.num_hidden_layers={cfg.model.num_hidden_layers} must be >= 1 or null (the preset's)",
    )
    if cfg.model.path is not None:
        _require(
            (Path(cfg.model.path) / "config.json").is_file(),
            "model.path",
            f"model.path={cfg.model.path!r} is not a Hugging Face checkpoint directory "
            "(no config.json); point it at one (a run writes its export RUN_DIR/hf when it ends: run the "
            "SFT this config starts from first), or set it to null to build model.preset",
        )
    critic_path = cfg.critic.model.path
    if critic_path is not None:
        _require(
            (Path(critic_path) / "config.json").is_file(),
            "critic.model.path",
            f"critic.model.path={critic_path!r} is not a Hugging Face checkpoint directory "
            "(no config.json); set it to null to start the critic from the actor's model",
        )


def read_model_config(cfg: RunConfig) -> dict | None:
    """config.json of model.path, or None (a preset's caller passes its dict explicitly)."""
    if cfg.model.path is None:
        return None
    return json.loads((Path(cfg.model.path) / "config.json").read_text())
