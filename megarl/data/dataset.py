"""Prompt datasets: read canonical rows, validate every one, tokenize, batch deterministically.

A canonical row (parquet or jsonl):
    prompt: [{"role": str, "content": str}, ...]       (the key is configurable: prompt_key)
    data_source: str                                    (selects the reward rule)
    reward_model: {"ground_truth": str, "style": "rule" | "model"}
    extra_info: dict                                    (null is read as {})

Problems are reported as "<file> row <i>: <what>" so a bad row can be found and fixed. A prompt
longer than max_prompt_length is one (overlong="error"), or is dropped, counted and reported
(overlong="filter": RLDataset.num_filtered, and a warning naming the first few rows).

data.train_files / val_files may list several files: without data.train_weights their rows form
one dataset; with them the train files are mixed by weight (mix.py). data.custom_cls replaces the
file reader with a user class (custom.py); its rows go through the same checks. build.py puts a
run's datasets together from its data config (plain, mixed or custom).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megarl.data.batch import Batch
from megarl.data.errors import DatasetError  # noqa: F401  (raised here, and importable from here)
from megarl.data.images import IMAGE_MARKER, ImageLimits, check_images

REWARD_STYLES = ("rule", "model")
OVERLONG = ("error", "filter")

log = logging.getLogger(__name__)


def read_rows(path: str | Path) -> list[dict]:
    """All rows of a .parquet or .jsonl file as dicts."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file {p} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if p.suffix == ".jsonl":
        rows = []
        for line_no, line in enumerate(p.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{p.name} line {line_no}: not valid JSON ({e.msg})") from None
        return rows
    raise DatasetError(f"dataset file {p} must be .parquet or .jsonl")


def _field(row: dict, dotted: str, expected: type | tuple[type, ...], where: str) -> Any:
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node or node[part] is None:
            raise DatasetError(f"{where}: missing field {dotted!r}")
        node = node[part]
    if not isinstance(node, expected):
        names = expected.__name__ if isinstance(expected, type) else "/".join(t.__name__ for t in expected)
        raise DatasetError(f"{where}: field {dotted!r} is a {type(node).__name__}, expected {names}")
    return node


def validate_row(row: dict, where: str, prompt_key: str = "prompt") -> dict:
    """The row with canonical types checked (extra_info null -> {}); raises DatasetError."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a mapping, got {type(row).__name__}")
    messages = _field(row, prompt_key, (list, np.ndarray), where)
    if len(messages) == 0:
        raise DatasetError(f"{where}: field {prompt_key!r} has no messages")
    for j, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DatasetError(f"{where}: {prompt_key}[{j}] must be a mapping with role and content")
        _field(message, "role", str, f"{where}: {prompt_key}[{j}]")
        _field(message, "content", str, f"{where}: {prompt_key}[{j}]")
    _field(row, "data_source", str, where)
    _field(row, "reward_model.ground_truth", str, where)
    style = _field(row, "reward_model.style", str, where)
    if style not in REWARD_STYLES:
        raise DatasetError(f"{where}: field 'reward_model.style' is {style!r}, expected one of {REWARD_STYLES}")
    if "extra_info" not in row:
        raise DatasetError(f"{where}: missing field 'extra_info'")
    extra = row["extra_info"] if row["extra_info"] is not None else {}
    if not isinstance(extra, dict):
        raise DatasetError(f"{where}: field 'extra_info' is a {type(extra).__name__}, expected dict")
    return {**row, prompt_key: [dict(m) for m in messages], "extra_info": extra}


def _row_images(row: dict, where: str, limits: ImageLimits | None, bad: str, prompt_key: str) -> list | None:
    """The row's images decoded (RGB PIL; [] without images), or None when they are ones the
    model cannot take and bad == "filter" (logged; the caller counts and drops the row); with bad
    == "error" such a row raises DatasetError. A model without a vision tower (limits None) takes
    none: its rows would train on the text alone, silently."""
    if row.get("images") is None or len(row["images"]) == 0:
        return []
    if limits is None:
        raise DatasetError(
            f"{where}: the row has images, but the model takes no images (it has no vision tower); "
            "use a vision-language model or rows without images"
        )
    try:
        return check_images(row, where, limits, prompt_key)
    except DatasetError as exc:
        if bad == "error":
            raise
        log.warning("dropped a row whose images the model cannot take (data.bad_images=filter): %s", exc)
        return None


def tokenize_prompt(tokenizer, messages: list[dict], image_placeholder: str | None = None) -> list[int]:
    """Token ids of the chat-templated prompt, ending with the assistant turn marker.
    `image_placeholder`: the text of the model's tokens for one image, put in place of each
    IMAGE_MARKER (a vision-language model's prompts; its rollout engine expands them)."""
    if image_placeholder is not None and any(IMAGE_MARKER in m["content"] for m in messages):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return [
            int(i) for i in tokenizer.encode(text.replace(IMAGE_MARKER, image_placeholder), add_special_tokens=False)
        ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # some tokenizers return an encoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


class RLDataset:
    """Validated, tokenized prompt rows; row i is a dict with canonical fields + raw_prompt_ids."""

    def __init__(
        self,
        rows: list[dict],
        tokenizer,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        source: str = "<rows>",
        overlong: str = "error",
        images: ImageLimits | None = None,
        bad_images: str = "error",
    ):
        if overlong not in OVERLONG or bad_images not in OVERLONG:
            raise DatasetError(f"overlong={overlong!r} and bad_images={bad_images!r} must be one of {OVERLONG}")
        self.source = source
        self.prompt_key = prompt_key
        self.rows: list[dict] = []
        filtered: list[str] = []  # "row i (n tokens)" of the prompts dropped for their length
        self.num_bad_images = 0
        for index, raw in enumerate(rows):
            where = f"{source} row {index}"
            row = validate_row(raw, where, prompt_key)
            decoded = _row_images(row, where, images, bad_images, prompt_key)
            if decoded is None:
                self.num_bad_images += 1
                continue
            ids = tokenize_prompt(tokenizer, row[prompt_key], images.placeholder if images is not None else None)
            if len(ids) > max_prompt_length:
                if overlong == "error":
                    raise DatasetError(
                        f"{where}: prompt is {len(ids)} tokens, longer than "
                        f"data.max_prompt_length={max_prompt_length}; raise the "
                        "limit, drop the row or set data.overlong_prompts=filter"
                    )
                filtered.append(f"row {index} ({len(ids)} tokens)")
                continue
            entry = {**row, "raw_prompt_ids": ids}
            entry.pop("images", None)  # a vision-language model's rows hold theirs decoded, [] for none
            self.rows.append(entry if images is None else {**entry, "images": decoded})
        self.num_filtered = len(filtered)
        if filtered:
            log.warning(
                "%s: dropped %d of %d prompts longer than data.max_prompt_length=%d: %s%s",
                source,
                len(filtered),
                len(rows),
                max_prompt_length,
                ", ".join(filtered[:5]),
                ", ..." if len(filtered) > 5 else "",
            )
        if not self.rows:
            reason = (
                f" (all {len(filtered)} were longer than data.max_prompt_length={max_prompt_length})"
                if filtered
                else ""
            )
            raise DatasetError(f"{source} has no rows{reason}")

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        tokenizer,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        overlong: str = "error",
        **images,
    ) -> RLDataset:
        """`images`: RLDataset's `images` and `bad_images`."""
        return cls(read_rows(path), tokenizer, max_prompt_length, prompt_key, Path(path).name, overlong, **images)

    @classmethod
    def concat(cls, parts: list[RLDataset]) -> RLDataset:
        """One dataset of several datasets' rows, in order (several files without weights)."""
        if len(parts) == 1:
            return parts[0]
        out = cls.__new__(cls)
        out.source = "+".join(p.source for p in parts)
        out.prompt_key = parts[0].prompt_key
        out.rows = [row for p in parts for row in p.rows]
        out.num_filtered = sum(p.num_filtered for p in parts)
        return out

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


class PromptBatches:
    """Deterministic epoch-shuffled prompt batches, addressable by step (for exact resume).

    Epoch e uses the permutation drawn from (seed, e); step s is batch s % steps_per_epoch of
    epoch s // steps_per_epoch. Each batch carries non-tensor columns raw_prompt_ids,
    raw_prompt, data_source, ground_truth, reward_style, extra_info and uid (unique per prompt
    per epoch: "e<epoch>-r<row>"), and for a vision-language model's dataset `images` (each row's
    decoded images, [] for none).
    """

    def __init__(
        self, dataset: RLDataset, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ):
        if batch_size < 1:
            raise DatasetError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise DatasetError(
                f"{dataset.source} has {len(dataset)} rows, fewer than one batch "
                f"of {batch_size}; lower data.train_batch_size or add rows"
            )
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.drop_last = drop_last
        full, rest = divmod(len(dataset), batch_size)
        self.steps_per_epoch = full if drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def batch_at(self, step: int) -> Batch:
        epoch, position = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        rows = order[position * self.batch_size : (position + 1) * self.batch_size]
        return self._make_batch([int(r) for r in rows], epoch, step)

    def _make_batch(self, indices: list[int], epoch: int, step: int) -> Batch:
        return prompt_batch(
            [self.dataset[i] for i in indices],
            self.dataset.prompt_key,
            [f"e{epoch}-r{i}" for i in indices],
            {"epoch": epoch, "step": step},
        )

    def iterate(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[Batch]:
        """Batches for steps start_step, start_step+1, ... (forever when num_steps is None)."""
        step = start_step
        while num_steps is None or step < start_step + num_steps:
            yield self.batch_at(step)
            step += 1

    def epoch(self, epoch: int = 0) -> Iterator[Batch]:
        """The batches of one epoch (e.g. a validation pass)."""
        return self.iterate(epoch * self.steps_per_epoch, self.steps_per_epoch)


def prompt_batch(rows: list[dict], prompt_key: str, uids: list[str], meta: dict) -> Batch:
    """The prompt columns of a batch of dataset rows (PromptBatches' contract)."""
    return Batch(
        non_tensors={
            "raw_prompt_ids": [r["raw_prompt_ids"] for r in rows],
            "raw_prompt": [r[prompt_key] for r in rows],
            "data_source": [r["data_source"] for r in rows],
            "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
            "reward_style": [r["reward_model"]["style"] for r in rows],
            "extra_info": [r["extra_info"] for r in rows],
            "uid": uids,
            # a vision-language model's datasets: every row's decoded images, [] for none
            **({"images": [r["images"] for r in rows]} if rows and "images" in rows[0] else {}),
        },
        meta=meta,
    )
