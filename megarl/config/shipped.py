"""The run configs shipped with megarl, found by name: `megarl train quickstart`.

The files live in the repository's configs/ folder; a wheel carries them as megarl/configs/
(pyproject.toml maps the package megarl.configs onto configs/). Either way the folder is called
`configs`, and the paths inside a shipped config that name shipped files are written from its
parent (`configs/data/sft-arith-tool-train.jsonl`, `configs/models/deepseek-v3`): read from a
clone's root they resolve as they are. From any other directory such a path names nothing, so a
shipped config's `configs/...` paths that do not exist from the working directory are read from
the folder that holds the shipped configs/ instead (they become absolute). Every other path
(outputs, checkpoints, a user's data) stays relative to the working directory.
"""

from __future__ import annotations

from pathlib import Path

# the keys of RunConfig that name files or folders; a shipped config may point them at configs/...
PATH_KEYS = (
    ("model", "path"),
    ("critic", "model", "path"),
    ("reward", "model", "path"),
    ("data", "train_files"),
    ("data", "val_files"),
    ("sft", "train_files"),
    ("sft", "val_files"),
)


def shipped_dir() -> Path:
    """megarl/configs/ in an installed wheel; the clone's configs/ next to megarl/ otherwise."""
    package = Path(__file__).resolve().parents[1]
    inside = package / "configs"
    return inside if inside.is_dir() else package.parent / "configs"


def shipped_names() -> list[str]:
    return sorted(p.stem for p in shipped_dir().glob("*.yaml"))


def is_config_name(text: str) -> bool:
    """A bare name (`quickstart`): no folder, no .yaml, and not a file in the working directory."""
    return "/" not in text and not text.endswith((".yaml", ".yml")) and not Path(text).is_file()


def find_shipped(name: str) -> Path | None:
    path = shipped_dir() / f"{name}.yaml"
    return path if path.is_file() else None


def is_shipped(path: Path) -> bool:
    return path.resolve().parent == shipped_dir().resolve()


def anchor_shipped_paths(data: dict) -> dict:
    """A shipped config's mapping with its `configs/...` paths that name nothing from the working
    directory made absolute against the folder holding the shipped configs/ (in place)."""
    base = shipped_dir().parent
    for keys in PATH_KEYS:
        section = data
        for key in keys[:-1]:
            section = section.get(key) if isinstance(section, dict) else None
        if not isinstance(section, dict) or keys[-1] not in section:
            continue
        value = section[keys[-1]]
        if isinstance(value, list):
            section[keys[-1]] = [_anchor(v, base) for v in value]
        else:
            section[keys[-1]] = _anchor(value, base)
    return data


def _anchor(value, base: Path):
    if not isinstance(value, str) or not value.startswith("configs/") or Path(value).exists():
        return value
    candidate = base / value
    return str(candidate) if candidate.exists() else value
