"""Where /update_weights_from_disk may read: `model_path` confined to allowed directories.

Without a confinement the endpoint opens whatever directory a caller names, so it can probe the
file system (which directories exist, which hold safetensors) and load weights from anywhere the
server's user can read. The allowed directories come from `--weight-dirs DIR[,DIR]` or, when the
flag is absent, the MEGARL_ROLLOUT_WEIGHT_DIRS environment variable (same format); with neither,
only the server's own --model-path (and what is under it). The fleet passes the run's weight
directory (RUN_DIR/weights, where the disk transport writes its checkpoints).

A path is checked after resolving symlinks and `..` (realpath), both the path itself and every
*.safetensors file in it (a symlinked file is followed to where it really is), and the engine is
handed the resolved path, so what was checked is what gets read. The allowed directories are
resolved at each check too: one created after the server started (the run's weight directory
appears at the first sync) is honoured.
"""

from __future__ import annotations

import os
from pathlib import Path

WEIGHT_DIRS_ENV = "MEGARL_ROLLOUT_WEIGHT_DIRS"
WEIGHT_DIRS_FLAG = "--weight-dirs"


class PathNotAllowed(ValueError):
    """model_path (or a file in it) resolves outside every allowed directory."""


def resolve_weight_dirs(flag_value: str | None, model_path: str) -> list[str]:
    """--weight-dirs wins; else the environment variable; else [model_path]. Absolute paths."""
    value = flag_value if flag_value is not None else os.environ.get(WEIGHT_DIRS_ENV)
    dirs = [d.strip() for d in (value or "").split(",") if d.strip()]
    return [os.path.abspath(d) for d in (dirs or [model_path])]


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def confine(model_path: str, allowed: list[str], key: str = "model_path") -> str:
    """The real path of `model_path` if it and its *.safetensors files lie under an allowed
    directory; PathNotAllowed (naming `key`, the body field, and the allowed directories, not where
    a link points) otherwise."""
    roots = [os.path.realpath(d) for d in allowed]
    real = os.path.realpath(model_path)
    where = f"allowed directories: {', '.join(allowed)} (the server's {WEIGHT_DIRS_FLAG} or {WEIGHT_DIRS_ENV})"
    if not _inside(real, roots):
        raise PathNotAllowed(f"{key} {model_path!r} is outside the {where}")
    if os.path.isdir(real):
        for file in sorted(Path(real).glob("*.safetensors")):
            target = os.path.realpath(file)
            if not _inside(target, roots):
                raise PathNotAllowed(f"{file.name} in {key} {model_path!r} links outside the {where}")
    return real
