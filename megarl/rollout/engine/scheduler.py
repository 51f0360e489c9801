"""The embedded engine's scheduler: continuous batching, with aborts, pauses and retractions
between forward steps. A mixin of `GenerationEngine` (generation.py), which owns the queue, the
locks and the request API.

One thread runs `_scheduler_loop`; each turn runs exactly one forward:

- a prefill, when queued rows fit (`max_batch_size` minus the running rows): they are left-padded
  and prefilled on their own cache, their first token is sampled, and they join the running
  batch: `RunningBatch.merge` left-pads the narrower of the two (cache columns and attention
  mask, kv_merge.py) and stacks the rows; positions stay per row;
- otherwise one decode step of the running batch (every row feeds its last sampled token).

A vision-language model's rows with images (vision.py) prefill with 3-D positions and their
images' features; they decode like any row, their positions carried ahead by their rope delta.

Rows leave the batch as soon as they finish (their callers are answered at once), and leading
cache columns that are padding for every remaining row are trimmed. Between two forwards the
scheduler resolves aborted rows, and honours a pause: `in_place` holds the batch and its KV cache
until /continue_generation; `retract` (SGLang's) puts the running rows back at the head of the
queue and frees their cache, so after continue they are prefilled again with prompt + the tokens
generated so far, under whatever weights are loaded then. `continuous_batching=False` keeps the
old behaviour (a batch runs to completion before queued requests start), for comparisons.

Each token records the `weight_version` read under the model lock of the forward step that
produced it (weights change only between steps), so a row that spans a weight update says which
of its tokens came from which weights (meta_info weight_versions).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megarl.rollout.engine.kv_cache import headroom_for
from megarl.rollout.engine.logit_processing import process_logits, token_steps
from megarl.rollout.engine.protocol import sample_next_tokens
from megarl.rollout.engine.rows import Row, fill_input_logprobs, stop_reason, wants_input_logprobs
from megarl.rollout.engine.vision import image_keys, prefill_inputs
from megarl.wire.routing import BatchCapture

log = logging.getLogger(__name__)


@dataclass
class RunningBatch:
    """Rows aligned with dim 0 of the cache and the mask; every row has sampled its last token
    and not fed it yet."""

    rows: list[Row]
    cache: object
    mask: torch.Tensor  # [rows, width]: 1 where the cache column holds one of the row's tokens
    positions: torch.Tensor  # [rows, 1]: the position of each row's last fed token

    def keep_unfinished(self, runner, device: torch.device) -> None:
        keep = [k for k, row in enumerate(self.rows) if row.finish is None]
        if len(keep) == len(self.rows):
            return
        if keep:  # finished rows leave the KV cache so later steps cost only what is still running
            index = torch.tensor(keep, device=device)
            self.cache.batch_select_indices(index)
            self.mask, self.positions = self.mask[index], self.positions[index]
            self.trim(runner)
        self.rows = [self.rows[k] for k in keep]

    def merge(self, other: RunningBatch, runner) -> None:
        """Append `other`'s rows (a prefill of joining requests); the narrower is left-padded."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(other.mask, width)])
        self.positions = torch.cat([self.positions, other.positions])
        runner.merge_caches(self.cache, other.cache)
        self.rows = self.rows + other.rows
        self.trim(runner)

    def trim(self, runner) -> None:
        """Drop leading columns that are padding for every row (each row's tokens are contiguous
        at the right, so its padding is the run of zeros its mask starts with)."""
        shared = int((self.mask.cumsum(1) == 0).sum(1).min())
        if shared:
            self.mask = self.mask[:, shared:]
            runner.trim_cache(self.cache, shared)


def _dedupe(fed: list[list[int]], keys: list | None = None) -> tuple[list[int], torch.Tensor | None]:
    """The rows of the distinct token lists (the first of each, in order), and each row's index
    into them (None when every row is distinct: nothing to share). `keys`: rows share a prefill
    only if their keys are equal too (a prompt's images, engine/vision.py: the same text with
    other images is another prompt)."""
    first: dict[tuple, int] = {}
    if keys is None:
        index = [first.setdefault(tuple(ids), len(first)) for ids in fed]
    else:
        index = [first.setdefault((tuple(ids), key), len(first)) for ids, key in zip(fed, keys)]
    if len(first) == len(fed):
        return list(range(len(fed))), None
    firsts = {}
    for k, j in enumerate(index):
        firsts.setdefault(j, k)
    return list(firsts.values()), torch.tensor(index)


def _pad_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros(mask.shape[0], width - mask.shape[1]), mask], dim=1)


class Scheduler:
    # set by GenerationEngine.__init__: runner, device, max_batch_size, continuous_batching, routing, vision,
    # eos_token_ids, stats, _cond, _queue, _running, _paused, _pause_mode, _quiet, _closed, _model_lock

    def _scheduler_loop(self) -> None:
        batch: RunningBatch | None = None
        while True:
            try:
                work = self._between_steps(batch)
            except Exception as exc:  # e.g. a cache edit failed: its rows fail, the engine keeps serving
                self._fail_running(exc, "removing finished rows")
                batch = None
                continue
            if work is None:
                break
            batch, admitted = work
            try:
                with torch.inference_mode():
                    batch = self._join(batch, admitted) if admitted else self._decode(batch)
            except Exception as exc:  # a failed step fails its rows, the engine keeps serving
                self._fail_running(exc, "generation step")
                batch = None
            with self._cond:
                self._running = list(batch.rows) if batch is not None else []
        with self._cond:
            for row in self._queue:
                row.req.future.set_exception(RuntimeError("the generation engine shut down"))
            self._queue.clear()
            self._running = []
            self._quiet = True
            self._cond.notify_all()

    def _fail_running(self, exc: Exception, what: str) -> None:
        log.exception("%s of %d rows failed", what, len(self._running))
        with self._cond:
            failed, self._running = self._running, []
        for row in failed:
            if not row.req.future.done():
                row.req.future.set_exception(RuntimeError(f"generation failed: {exc!r}"))

    def _between_steps(self, batch: RunningBatch | None):
        """Resolve aborted rows, honour pause / released weights / shutdown, admit queued rows.
        Returns (batch, rows to prefill now) or None when the engine is closing."""
        while True:
            with self._cond:
                closing = self._closed
                aborted = [r for r in self._running if r.finish is None and (closing or r.abort_message)]
                if not aborted:
                    if closing:
                        return None
                    if self._paused or not self.weights_ready:
                        if self._paused and self._pause_mode == "retract" and batch is not None:
                            self._retract(batch)
                            batch = None
                        self._wait_quietly()
                        continue
                    running = batch.rows if batch is not None else []
                    room = self.max_batch_size - len(running)
                    if running and not self.continuous_batching:
                        room = 0
                    admitted = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
                    if admitted or running:
                        self._running, self._quiet = running + admitted, False
                        self.stats["max_rows"] = max(self.stats["max_rows"], len(self._running))
                        return batch, admitted
                    self._wait_quietly()
                    continue
            for row in aborted:
                self._resolve(
                    row, {"type": "abort", "message": "the engine is shutting down" if closing else row.abort_message}
                )
            if batch is not None:
                batch.keep_unfinished(self.runner, self.device)
                batch = batch if batch.rows else None
            with self._cond:
                self._running = [r for r in self._running if r.finish is None]

    def _wait_quietly(self) -> None:
        """(Under _cond.) No forward is running or about to: tell pause() so, then wait."""
        self._quiet = True
        self._cond.notify_all()
        self._cond.wait()

    def _retract(self, batch: RunningBatch) -> None:
        """(Under _cond.) SGLang's retract: the running rows go back to the head of the queue, in
        order, and their KV cache is freed (dropping the batch frees it, on every TP rank)."""
        for row in batch.rows:
            row.retractions += 1
        self._queue.extendleft(reversed(batch.rows))
        self.stats["retracted"] += len(batch.rows)
        self._running = []

    def _join(self, batch: RunningBatch | None, admitted: list[Row]) -> RunningBatch | None:
        """Prefill the admitted rows on their own cache, sample their first token, merge them in.

        Rows that feed the same tokens (the n samples of one prompt) are prefilled once and each
        gets a copy of that KV row, as SGLang's prefix cache shares them: a prefill of n x prompt
        tokens costs one prompt's. Not when a row wants its input log-probs or its experts (those
        records are per row). Rows with images share only with rows of the same images."""
        fed = [row.fed_ids() for row in admitted]
        want_input_lp = any(wants_input_logprobs(row) for row in admitted)
        routing = BatchCapture.start(self.routing, admitted)  # None unless a row asked for its experts
        vision = self.vision is not None and any(row.req.images is not None for row in admitted)
        firsts, index = None, None
        if not want_input_lp and routing is None:
            firsts, index = _dedupe(fed, image_keys(admitted) if vision else None)
        unique = fed if index is None else [fed[k] for k in firsts]
        ids, mask = self._left_pad(unique)
        images = None
        if vision:  # 3-D positions, the images' features at their pads (engine/vision.py)
            rows = admitted if index is None else [admitted[k] for k in firsts]
            positions, last, images = prefill_inputs(rows, mask, self.device)
        else:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            last = positions[:, -1:]
        remaining = max(row.req.params.max_new_tokens - len(row.output_ids) for row in admitted)
        cache = self.runner.new_cache(headroom_for(remaining))
        out, version = self._forward(ids, mask, positions, cache, keep_all=want_input_lp, images=images)
        self.stats["prefill_rows"] += len(unique)
        logits = out.logits[:, -1]
        if index is not None:
            out.past_key_values.batch_select_indices(index.to(self.device))
            mask, last, logits = mask[index], last[index], logits[index]
        if routing is not None:
            routing.prefill(ids.shape[1])
        if want_input_lp:
            fill_input_logprobs(admitted, out.logits, ids)
        joined = RunningBatch(admitted, out.past_key_values, mask, last)
        for row in admitted:
            if row.req.params.max_new_tokens == 0:
                self._resolve(row, {"type": "length", "length": 0})
        live = [k for k, row in enumerate(admitted) if row.finish is None]
        if live:
            self._sample_into_rows([admitted[k] for k in live], logits[live], version)
        joined.keep_unfinished(self.runner, self.device)
        if batch is None:
            self.stats["batches"] += 1
        else:
            self.stats["joined"] += len(admitted)
        if batch is not None and joined.rows:
            batch.merge(joined, self.runner)
        batch = batch if batch is not None else joined
        return batch if batch.rows else None

    def _decode(self, batch: RunningBatch) -> RunningBatch | None:
        next_ids = torch.tensor([[row.output_ids[-1]] for row in batch.rows], device=self.device)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.rows), 1)], dim=1)
        batch.positions = batch.positions + 1
        routing = BatchCapture.start(self.routing, batch.rows)
        out, version = self._forward(next_ids, batch.mask, batch.positions, batch.cache, keep_all=False)
        if routing is not None:
            routing.decode(list(range(len(batch.rows))))
        self._sample_into_rows(batch.rows, out.logits[:, -1], version)
        batch.keep_unfinished(self.runner, self.device)
        return batch if batch.rows else None

    def _forward(self, ids, mask, positions, cache, keep_all: bool, images=None):
        """(model output, the weight_version it ran with). `images`: a vision prefill's (vision.py)."""
        extra = {} if images is None else {"images": images}
        while True:  # weights may be released between the caller's check and this lock
            with self._model_lock:
                if self.weights_ready:
                    self.stats["forward_steps"] += 1
                    return self.runner.forward(ids, mask, positions, cache, keep_all, **extra), self.weight_version
            with self._cond:
                while not self.weights_ready and not self._closed:
                    self._wait_quietly()
                if self._closed:
                    raise RuntimeError("the engine shut down while weights were released")
                self._quiet = False

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        # padded as lists, one tensor each: two indexed writes per row cost 10% of the engine's CPU
        ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        return ids.to(self.device), mask.to(self.device)

    def _sample_into_rows(self, rows: list[Row], logits: torch.Tensor, version: str) -> None:
        requests = [row.req for row in rows]
        params = [r.params for r in requests]
        logits = process_logits(logits.float(), params, [row.output_ids for row in rows], self.eos_token_ids)
        tokens, logprobs = sample_next_tokens(
            logits,
            [p.temperature for p in params],
            [p.top_p for p in params],
            [p.top_k for p in params],
            [row.generator for row in rows],
            min_ps=[p.min_p for p in params],
        )
        for row, step in zip(rows, token_steps(logits, requests, tokens.tolist(), logprobs.tolist(), version)):
            row.record(step)
            finish = stop_reason(row, self.eos_token_ids, self.decode)
            if finish is not None:
                self._resolve(row, finish)
