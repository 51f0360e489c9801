"""data.custom_cls: a user class makes the prompt rows in place of the parquet/jsonl reader.

The spec is "path/to/file.py:ClassName" or "package.module:ClassName". The class is called once
per file of a split, or once with path=None when that split names no files (it then makes its
rows itself, as data.task does):

    class MyRows:
        def __init__(self, path: str | None, tokenizer, config: DataConfig, split: str):
            # path: one entry of data.train_files / data.val_files, as written (any string: a
            #   .csv, a directory, a hub name; megarl neither checks nor opens it), or None;
            # tokenizer: the run's Hugging Face tokenizer (to measure or shorten prompts);
            # config: the run's DataConfig (max_prompt_length, prompt_key, seed, num_train, ...);
            # split: "train" or "val" (None-path val rows are made when data.num_val > 0)
            ...
        def __len__(self) -> int: ...
        def __getitem__(self, index: int) -> dict: ...   # or __iter__: any iterable of rows

Each row must be a canonical row (megarl/data/dataset.py: prompt messages, data_source,
reward_model {ground_truth, style}, extra_info). megarl then does what it does for a file: every
row is validated (an error names the class, the path and the row), the prompt tokenized with the
chat template, overlong prompts refused or filtered (data.overlong_prompts), and the rows batched,
shuffled, mixed (data.train_weights) and checkpointed exactly like a file's. The class only turns
the user's data into rows; it never sees batches, so resume and mixing need nothing from it.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from megarl.data.dataset import DatasetError, RLDataset

KEY = "data.custom_cls"


def load_class(spec: str) -> type:
    """The class named by `spec`, imported; DatasetError naming data.custom_cls otherwise."""
    module_name, sep, cls_name = spec.rpartition(":")
    if not sep or not module_name or not cls_name.isidentifier():
        raise DatasetError(f"{KEY}={spec!r} must look like 'path/to/file.py:ClassName' or 'package.module:ClassName'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise DatasetError(
                    f"{KEY}={spec!r}: file {path} does not exist; give a path "
                    "relative to the directory the run starts in, or an absolute one"
                )
            module_spec = importlib.util.spec_from_file_location(f"megarl_custom_data_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise DatasetError(
            f"{KEY}={spec!r}: cannot import {module_name!r} ({e}); is the package installed, or on PYTHONPATH?"
        ) from e
    cls = getattr(module, cls_name, None)
    if cls is None:
        known = sorted(n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_"))
        raise DatasetError(
            f"{KEY}={spec!r}: {module_name!r} has no {cls_name!r} (its classes: {', '.join(known) or 'none'})"
        )
    if not callable(cls):
        raise DatasetError(f"{KEY}={spec!r}: {cls_name!r} is a {type(cls).__name__}, not a class")
    return cls


def custom_rows(cls: type, spec: str, path: str | None, tokenizer, config, split: str) -> list:
    """The rows `cls(path, tokenizer, config, split)` holds, as a list (not yet validated)."""
    name = getattr(cls, "__name__", spec)
    call = f"{name}({path!r}, tokenizer, config, split={split!r})"
    try:
        made = cls(path, tokenizer, config, split)
    except DatasetError:
        raise
    except Exception as e:  # the user's code: say whose call failed, keep the cause chained
        raise DatasetError(f"{KEY}={spec!r}: {call} raised {type(e).__name__}: {e}") from e
    try:
        return list(made)
    except TypeError:
        raise DatasetError(
            f"{KEY}={spec!r}: {call} gave a {type(made).__name__}, which is not a "
            "sequence of rows; the class must define __len__ and __getitem__ (or "
            "__iter__) returning canonical row dicts (megarl/data/custom.py)"
        ) from None


def custom_dataset(cls: type, spec: str, path: str | None, tokenizer, config, split: str) -> RLDataset:
    """`cls`'s rows validated, tokenized and length-checked like a file's."""
    rows = custom_rows(cls, spec, path, tokenizer, config, split)
    where = f"{KEY} {getattr(cls, '__name__', spec)}({Path(path).name if path else split})"
    try:
        return RLDataset(rows, tokenizer, config.max_prompt_length, config.prompt_key, where, config.overlong_prompts)
    except DatasetError as e:
        raise DatasetError(f"{e} (rows made by {KEY}={spec!r}; the row format is in megarl/data/dataset.py)") from None
