"""Several train files drawn from by weight (data.train_files + data.train_weights).

Each prompt of a batch comes from file i with probability w_i / sum(w): the batch's counts per
file are one multinomial draw seeded by (data.seed, step), so a batch of B prompts holds about
B * w_i / sum(w) of file i, and over many steps the fractions converge to the weights (the
tests check 2000 batches within 1%). The draws of 1024 consecutive steps come from one generator
seeded by (data.seed, step // 1024). Within a file, prompts are taken in that file's own
epoch-shuffled order (seeded by data.seed, the file and its epoch), so every prompt of a file is
used once before any repeats; each file has its own epochs, and a small file with a large weight
goes through more of them. uid is "m<file>-e<file epoch>-r<row>".

batch_at(step) is a pure function of the step (resume continues exactly): the position of each
file's cursor before a step is the sum of the earlier steps' counts, computed once and cached
(100,000 steps take about 0.1 s). The train-set identity a checkpoint records
(`identity()`) holds every file's name, size and weight, so a resume with another mix is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from megarl.data.batch import Batch
from megarl.data.dataset import DatasetError, PromptBatches, RLDataset, prompt_batch

_MIX = 0x6D6978  # "mix": keeps these streams apart from PromptBatches' (seed, epoch) permutations
_BLOCK = 1024  # steps whose counts are drawn together (one generator per block of steps)


def source_names(paths: list) -> list[str]:
    """Short unique names of the train files (their stems; a repeated stem gets _2, _3, ...)."""
    names: list[str] = []
    for path in paths:
        stem = Path(str(path)).stem or str(path)
        name, k = stem, 2
        while name in names:
            name, k = f"{stem}_{k}", k + 1
        names.append(name)
    return names


class MixedDataset:
    """One RLDataset per train file and the weight each is drawn with."""

    def __init__(self, parts: list[RLDataset], weights: list[float], names: list[str]):
        if len(weights) != len(parts):
            raise DatasetError(
                f"data.train_weights has {len(weights)} weights for {len(parts)} "
                "data.train_files; give one weight per file"
            )
        if any(not np.isfinite(w) or w <= 0 for w in weights):
            raise DatasetError(
                f"data.train_weights={list(weights)} must all be > 0 (leave a file "
                "out of data.train_files instead of giving it weight 0)"
            )
        self.parts, self.names = parts, list(names)
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.prompt_key = parts[0].prompt_key
        self.source = "+".join(p.source for p in parts)
        self.num_filtered = sum(p.num_filtered for p in parts)

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def identity(self) -> dict:
        """What a checkpoint records of the mix: a resume with other files or weights is refused."""
        return {"mix": [[name, len(part), float(w)] for name, part, w in zip(self.names, self.parts, self.weights)]}


class MixedPromptBatches:
    """Batches of `batch_size` prompts drawn from a MixedDataset, addressable by step."""

    def __init__(self, mixed: MixedDataset, batch_size: int, shuffle: bool = True, seed: int = 0):
        if batch_size < 1:
            raise DatasetError(f"batch_size must be >= 1, got {batch_size}")
        self.mixed, self.batch_size, self.shuffle, self.seed = mixed, batch_size, shuffle, seed
        self._before = np.zeros((1, len(mixed.parts)), dtype=np.int64)  # row k: counts before step k
        self._orders: dict[tuple[int, int], np.ndarray] = {}
        self._blocks: dict[int, np.ndarray] = {}

    def _block(self, block: int) -> np.ndarray:
        """Counts of steps block*_BLOCK .. (block+1)*_BLOCK - 1, drawn by one generator."""
        if block not in self._blocks:
            if len(self._blocks) > 2:
                self._blocks.clear()
            rng = np.random.default_rng([self.seed, _MIX, block])
            self._blocks[block] = rng.multinomial(self.batch_size, self.mixed.weights, size=_BLOCK)
        return self._blocks[block]

    def counts_at(self, step: int) -> np.ndarray:
        """Prompts of each file in step `step`'s batch."""
        return self._block(step // _BLOCK)[step % _BLOCK]

    def taken_before(self, step: int) -> np.ndarray:
        """Prompts taken from each file by steps 0 .. step-1 (cached: each step is drawn once)."""
        known = len(self._before) - 1
        if step > known:
            counts = np.concatenate([self._block(b) for b in range(known // _BLOCK, (step - 1) // _BLOCK + 1)])
            counts = counts[known - (known // _BLOCK) * _BLOCK :][: step - known]
            self._before = np.concatenate([self._before, self._before[-1] + np.cumsum(counts, 0)])
        return self._before[step]

    def file_order(self, source: int, epoch: int) -> np.ndarray:
        size = len(self.mixed.parts[source])
        if not self.shuffle:
            return np.arange(size)
        key = (source, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * len(self.mixed.parts):  # the current epochs suffice
                self._orders.clear()
            self._orders[key] = np.random.default_rng([self.seed, _MIX, source + 1, epoch]).permutation(size)
        return self._orders[key]

    def batch_at(self, step: int) -> Batch:
        start, counts = self.taken_before(step), self.counts_at(step)
        rows, uids = [], []
        for source, (first, n) in enumerate(zip(start.tolist(), counts.tolist())):
            part = self.mixed.parts[source]
            for position in range(first, first + n):
                epoch, offset = divmod(position, len(part))
                row = int(self.file_order(source, epoch)[offset])
                rows.append(part[row])
                uids.append(f"m{source}-e{epoch}-r{row}")
        if self.shuffle:  # files interleaved in the batch, not in blocks
            order = np.random.default_rng([self.seed, _MIX, step, 1]).permutation(len(rows))
            rows, uids = [rows[i] for i in order], [uids[i] for i in order]
        fractions = {
            f"data/source_frac/{name}": c / self.batch_size for name, c in zip(self.mixed.names, counts.tolist())
        }
        return prompt_batch(rows, self.mixed.prompt_key, uids, {"step": step, "metrics": fractions})

    def iterate(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[Batch]:
        step = start_step
        while num_steps is None or step < start_step + num_steps:
            yield self.batch_at(step)
            step += 1


def make_prompt_batches(train, data_cfg) -> PromptBatches | MixedPromptBatches:
    """The train batches of a run: a mix for a MixedDataset, else PromptBatches (epoch-shuffled)."""
    if isinstance(train, MixedDataset):
        return MixedPromptBatches(train, data_cfg.train_batch_size, data_cfg.shuffle, data_cfg.seed)
    return PromptBatches(train, data_cfg.train_batch_size, data_cfg.shuffle, data_cfg.seed)


def data_mix_identity(train) -> dict:
    """The mix's part of a checkpoint's data identity ({} for one dataset: old checkpoints resume)."""
    return train.identity() if isinstance(train, MixedDataset) else {}
