"""The experiment trackers a run's per-step metrics go to (trainer.loggers, trainer.wandb,
trainer.mlflow); the writers are megarl/trainer/trackers.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# console: the step line; jsonl: RUN_DIR/metrics.jsonl (always: resume, compare-runs and plot read
# it); tensorboard: RUN_DIR/tensorboard; wandb: Weights & Biases; mlflow: an MLflow tracking store
LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]


@dataclass
class WandbConfig:
    project: str = "megarl"
    entity: str | None = None  # null: the account's default entity
    # offline: the run is written under RUN_DIR/wandb (`wandb sync` uploads it later), so a run
    # needs neither network nor an account; online streams to the server (WANDB_API_KEY or `wandb login`)
    mode: Literal["online", "offline", "disabled"] = "offline"
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class MlflowConfig:
    tracking_uri: str | None = None  # null: file:RUN_DIR/mlruns (MLflow's local file store)
    experiment_name: str = "megarl"
