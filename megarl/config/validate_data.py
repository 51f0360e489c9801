"""Checks of the data files, the train mix, data.custom_cls, the procedural task and the validation
options."""

from __future__ import annotations

import math
import re
from pathlib import Path

from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig

_DATA_SUFFIXES = (".parquet", ".jsonl")
_CLASS_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def check_data(cfg: RunConfig) -> None:
    d, t = cfg.data, cfg.trainer
    check_custom_cls(d.custom_cls)
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        check_files(key, files, custom=d.custom_cls is not None)
    weights = d.train_weights
    if weights is not None:
        _require(
            d.train_files is not None,
            "data.train_weights",
            "data.train_weights is set but data.train_files is null; weights choose between "
            "train files: list the files, or remove the weights",
        )
        files = [d.train_files] if isinstance(d.train_files, str) else d.train_files
        _require(
            len(weights) == len(files),
            "data.train_weights",
            f"data.train_weights has {len(weights)} weights for {len(files)} data.train_files; "
            "give one weight per file, in the same order",
        )
        _require(
            all(math.isfinite(w) and w > 0 for w in weights),
            "data.train_weights",
            f"data.train_weights={weights} must all be > 0 (relative: [3, 1] draws three "
            "prompts of the first file for one of the second); leave a file out rather than "
            "give it weight 0",
        )
    _require(t.val_n >= 1, "trainer.val_n", f"trainer.val_n={t.val_n} must be >= 1 (samples per val prompt)")
    _require(
        t.val_n == 1 or cfg.rollout.val_temperature > 0,
        "trainer.val_n",
        f"trainer.val_n={t.val_n} samples each val prompt {t.val_n} times, but "
        "rollout.val_temperature=0 decodes greedily, so every sample would be the same answer "
        "(pass@k = mean@k = pass@1); set rollout.val_temperature > 0 (e.g. 1.0) or trainer.val_n=1",
    )
    _require(
        math.isfinite(t.val_pass_threshold),
        "trainer.val_pass_threshold",
        f"trainer.val_pass_threshold={t.val_pass_threshold} must be a finite number (a val "
        "sample whose reward is >= it counts as solved)",
    )


def check_files(key: str, files, custom: bool) -> None:
    """One path or a non-empty list; without data.custom_cls each an existing .parquet/.jsonl."""
    if files is None:
        return
    paths = [files] if isinstance(files, str) else files
    _require(len(paths) > 0, key, f"{key}=[] names no file; give at least one, or null")
    for path in paths:
        _require(bool(path.strip()), key, f"{key} has an empty path")
        if custom:  # the class reads them: any string it understands
            continue
        _require(
            path.endswith(_DATA_SUFFIXES),
            key,
            f"{key}={path!r} must end in {' or '.join(_DATA_SUFFIXES)}"
            + (" (or set data.custom_cls to a class that reads it)" if key.startswith("data.") else ""),
        )
        _require(Path(path).is_file(), key, f"{key}={path!r} does not exist")


def check_custom_cls(spec: str | None) -> None:
    """Its form, and that a .py file exists; the class itself is imported when the data is read."""
    if spec is None:
        return
    if ".py:" in spec:
        path, _, name = spec.rpartition(":")
        _require(name.isidentifier(), "data.custom_cls", f"data.custom_cls={spec!r}: {name!r} is not a class name")
        _require(Path(path).is_file(), "data.custom_cls", f"data.custom_cls={spec!r}: file {path} does not exist")
    else:
        _require(
            bool(_CLASS_REF.match(spec)),
            "data.custom_cls",
            f"data.custom_cls={spec!r} must look like 'path/to/file.py:ClassName' or 'package.module:ClassName'",
        )


def check_task(cfg: RunConfig) -> None:
    """data.task: a built-in procedural task or rg:<a reasoning-gym dataset> (used when a file is null)."""
    task = cfg.data.task
    if task in ("digits", "arith", "arith_tool", "add20", "shapes"):
        return
    _require(
        task.startswith("rg:") and len(task) > 3,
        "data.task",
        f"data.task={task!r} must be digits, arith, arith_tool, add20, shapes or rg:<reasoning-gym dataset> "
        "(e.g. rg:basic_arithmetic)",
    )
    if cfg.data.train_files is None or (cfg.data.val_files is None and cfg.data.num_val > 0):
        try:
            from reasoning_gym.factory import DATASETS
        except ImportError as err:
            raise ConfigError(
                "data.task",
                f"data.task={task!r} needs the reasoning-gym package ({err}); scripts/setup_env.sh installs it",
            ) from err
        _require(
            task[3:] in DATASETS,
            "data.task",
            f"data.task={task!r}: reasoning-gym has no dataset {task[3:]!r}; known: {', '.join(sorted(DATASETS))}",
        )
