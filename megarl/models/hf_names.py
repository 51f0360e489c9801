"""Checkpoint names and the names a loaded model gives the same tensors.

transformers renames some models' tensors when it loads them: a vision-language model's class
lists regexes in `_checkpoint_conversion_mapping` (Qwen2.5-VL: `model.layers...` ->
`model.language_model.layers...`, `visual...` -> `model.visual...`), applies the first that
matches each checkpoint key, and applies them backwards when it saves. The trainer exports, and
clients send, the checkpoint's names; the engine's parameters carry the loaded model's. The
engine maps every name it is sent with the model's own regexes, so an update by checkpoint names
and one by the loaded model's names land on the same parameters, and a model without a mapping
(every text model) keeps its names untouched and pays nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable

Rename = Callable[[str], str]


def checkpoint_renamer(model) -> Rename | None:
    """checkpoint name -> the loaded model's name, as transformers maps keys at load (the first
    matching regex of the class's `_checkpoint_conversion_mapping`); None when the class renames
    nothing. Idempotent on the model's own names (the regexes exclude what they produce)."""
    mapping = getattr(model, "_checkpoint_conversion_mapping", None) or {}
    if not mapping:
        return None
    rules = [(re.compile(pattern), replacement) for pattern, replacement in mapping.items()]

    def rename(name: str) -> str:
        for pattern, replacement in rules:
            new, count = pattern.subn(replacement, name)
            if count:
                return new
        return name

    return rename


def model_to_checkpoint(model, names) -> dict[str, str]:
    """{the model's name: the checkpoint's name} for `names`, by transformers' save-time rule
    (the mapping reversed, its patterns' anchors and groups dropped); a name whose reverse does
    not map back to it keeps its own name."""
    rename = checkpoint_renamer(model)
    if rename is None:
        return {name: name for name in names}
    reverse = []
    for pattern, replacement in model._checkpoint_conversion_mapping.items():
        reverse.append((re.compile(replacement), re.sub(r"\(.*\)", "", pattern.lstrip("^"))))
    out = {}
    for name in names:
        saved = name
        for pattern, replacement in reverse:
            saved, count = pattern.subn(replacement, name)
            if count:
                break
        out[name] = saved if rename(saved) == name else name
    return out
