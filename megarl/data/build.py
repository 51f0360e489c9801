"""A run's train and val datasets from its data config: plain files, a weighted mix, a user class.

The one place that chooses between the dataset kinds: dataset.py reads and checks rows, mix.py
and custom.py build on it, and this module builds on all three.
"""

from __future__ import annotations

from pathlib import Path

from megarl.data.custom import custom_dataset, load_class
from megarl.data.dataset import RLDataset
from megarl.data.mix import MixedDataset, source_names
from megarl.data.tasks import write_task


def as_paths(files: str | list[str] | None) -> list[str]:
    """data.train_files / val_files as a list (a single string is one file)."""
    return [] if files is None else [files] if isinstance(files, str) else list(files)


def build_datasets(data_cfg, tokenizer, work_dir: str | Path, image_limits=None):
    """Train and val datasets from a DataConfig; procedural tasks are written under work_dir.

    train: an RLDataset (one file, several files' rows together, or `task` generated), or with
    data.train_weights a MixedDataset (mix.py) of one RLDataset per file. val: one RLDataset of
    every val file's rows, generated (seed + 1) when val_files is null and num_val > 0, else None.
    With data.custom_cls its class makes each file's rows, and the rows of a split without files.
    `image_limits` (data/images.py ImageLimits): what a vision-language model's images must meet;
    None for a model without a vision tower, whose datasets then refuse rows with images.
    """
    custom = load_class(data_cfg.custom_cls) if data_cfg.custom_cls is not None else None
    args = (tokenizer, data_cfg.max_prompt_length, data_cfg.prompt_key, data_cfg.overlong_prompts)

    def read(path: str | Path | None, split: str) -> RLDataset:
        if custom is not None:
            return custom_dataset(
                custom, data_cfg.custom_cls, None if path is None else str(path), tokenizer, data_cfg, split
            )
        return RLDataset.from_file(path, *args, images=image_limits, bad_images=data_cfg.bad_images)

    work = Path(work_dir)
    stem = data_cfg.task.replace(":", "_")  # rg:countdown -> rg_countdown_train.parquet
    train_paths = as_paths(data_cfg.train_files)
    if not train_paths and custom is None:
        train_paths = [write_task(data_cfg.task, data_cfg.num_train, data_cfg.seed, work / f"{stem}_train.parquet")]
    parts = [read(p, "train") for p in train_paths] or [read(None, "train")]
    if data_cfg.train_weights is not None:
        train = MixedDataset(parts, data_cfg.train_weights, source_names(train_paths))
    else:
        train = RLDataset.concat(parts)
    val_paths = as_paths(data_cfg.val_files)
    if not val_paths and data_cfg.num_val > 0:
        if custom is not None:
            return train, read(None, "val")
        val_paths = [
            write_task(data_cfg.task, data_cfg.num_val, data_cfg.seed + 1, work / f"{stem}_val.parquet", "val")
        ]
    val = RLDataset.concat([read(p, "val") for p in val_paths]) if val_paths else None
    return train, val
