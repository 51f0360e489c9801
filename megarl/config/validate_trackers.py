"""trainer.loggers: the list itself, and every tracker it names importable, before any process starts."""

from __future__ import annotations

import importlib.util

from megarl.config.loader import ConfigError

# logger -> (the module its writer imports, the install line: the package's extra, or the pin requirements.lock holds)
TRACKER_PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard==2.21.0"),
    "wandb": ("wandb", "pip install 'megarl[wandb]' (or pip install wandb==0.31.0)"),
    "mlflow": ("mlflow", "pip install 'megarl[mlflow]' (or pip install mlflow-skinny==3.17.2)"),
}


def check_loggers(cfg) -> None:
    loggers = cfg.trainer.loggers
    twice = sorted({name for name in loggers if loggers.count(name) > 1})
    if twice:
        raise ConfigError(
            "trainer.loggers", f"trainer.loggers={loggers} names {', '.join(twice)} twice; list each once"
        )
    if "jsonl" not in loggers:
        raise ConfigError(
            "trainer.loggers",
            f"trainer.loggers={loggers} leaves out jsonl, but RUN_DIR/metrics.jsonl is the run's own record "
            "(resume, megarl compare-runs and megarl plot read it); add jsonl, e.g. "
            f"trainer.loggers=[{','.join(['jsonl', *loggers])}]",
        )
    for name in loggers:
        if name in TRACKER_PACKAGES:
            module, install = TRACKER_PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                raise ConfigError("trainer.loggers", f"trainer.loggers: {name} is not installed; {install}")
