"""The embedded rollout engine: a Hugging Face causal LM behind a batching scheduler thread.

Requests queue up; one scheduler thread takes up to `max_batch_size` of them, left-pads them and
runs prefill + decode with the HF KV cache until every row has stopped (a batch runs to
completion; requests arriving meanwhile wait for the next batch). Rows that finish early are
dropped from the batch and their callers answered at once.

The model sits behind a runner (tp/runner.py): loaded in this process, or sharded over the ranks
of a tensor-parallel mesh of which this process is rank 0.

Weights change only between forward steps (`_model_lock`), so a running batch may continue with
new weights, as SGLang's in-place pause does (engine_weights.py: updates, staging, release).
Log-probs follow megarl's contract: log_softmax(logits / temperature) over the full vocabulary;
temperature 0 is greedy with log-probs of the raw logits. A request's penalties, logit_bias and
min_new_tokens change the logits first (logit_processing.py says how); its log-probs are then those
of the changed logits, as in SGLang.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from dataclasses import dataclass

import torch

from megarl.rollout.engine_weights import EngineWeights
from megarl.rollout.logit_processing import process_logits, token_steps
from megarl.rollout.protocol import GenerationRequest, InvalidRequest, WeightsUnavailable, sample_next_tokens
from megarl.rollout.rows import Row as _Row
from megarl.rollout.routing import BatchCapture, RoutingRecorder
from megarl.rollout.rows import fill_input_logprobs, finished_result, stop_reason
from megarl.rollout.tp.runner import LocalRunner

log = logging.getLogger(__name__)


@dataclass
class _Batch:
    """The running batch: `active` row indices aligned with dim 0 of the cache, mask, positions."""

    active: list[int]
    cache: object
    mask: torch.Tensor
    positions: torch.Tensor

    def keep_unfinished(self, rows: list[_Row], device: torch.device) -> None:
        keep = [k for k, i in enumerate(self.active) if rows[i].finish is None]
        if len(keep) == len(self.active):
            return
        if keep:  # finished rows leave the KV cache so later steps cost only what is still running
            index = torch.tensor(keep, device=device)
            self.cache.batch_select_indices(index)
            self.mask, self.positions = self.mask[index], self.positions[index]
        self.active = [self.active[k] for k in keep]


class GenerationEngine(EngineWeights):
    def __init__(self, model_path: str, tokenizer_path: str | None = None, device: str = "cpu",
                 dtype: str = "float32", max_batch_size: int = 32, seed: int | None = None,
                 runner=None):
        """`runner`: the model's ranks (megarl.rollout.tp.runner.TPRunner for --tp > 1); by default
        the model is loaded into this process (LocalRunner)."""
        from transformers import AutoTokenizer

        self.model_path, self.tokenizer_path = str(model_path), str(tokenizer_path or model_path)
        self.device, self.dtype, self.max_batch_size = torch.device(device), dtype, max_batch_size
        self.runner = runner if runner is not None else LocalRunner(self.model_path, dtype, self.device)
        self.model = self.runner.model  # rank 0's shard under TP
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        self.vocab_size = self.runner.vocab_size
        self.context_length = getattr(self.model.config, "max_position_embeddings", None)
        self.eos_token_ids = self._collect_eos_ids()
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.weight_version = "default"
        self.routing = RoutingRecorder.attach(self.model)  # None: no MoE router to record
        self._tensors_by_name = self.model.state_dict(keep_vars=True)  # HF name -> Parameter/buffer
        self._unfilled: set[str] = set()  # params re-allocated by resume, awaiting an update
        self._weights_resident = True
        self._generator = torch.Generator()
        self._generator.manual_seed(seed) if seed is not None else self._generator.seed()
        self._model_lock = threading.Lock()  # held for each forward and each weight write
        self._tokenizer_lock = threading.Lock()  # fast tokenizers dislike concurrent use
        self._cond = threading.Condition()  # guards the queue, pause, abort and weight state
        self._queue: collections.deque[GenerationRequest] = collections.deque()
        self._running: list[GenerationRequest] = []
        self._abort_rids: dict[str, str] = {}  # running rid -> abort message
        self._paused = False
        self._closed = False
        self.stats = collections.Counter()  # batches, forward_steps, requests_finished, max_rows
        self._thread = threading.Thread(target=self._scheduler_loop, name="rollout-engine", daemon=True)
        self._thread.start()

    # ---- requests -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            return self.tokenizer.encode(text)  # special tokens added as SGLang does

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        with self._tokenizer_lock:  # the spaces flag matters to slow tokenizers; fast ones ignore it
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                         spaces_between_special_tokens=spaces_between_special_tokens)

    def validate(self, req: GenerationRequest, where: str = "input_ids") -> None:
        ids = req.input_ids
        if not ids:
            raise InvalidRequest(f"{where} is empty; a prompt needs at least one token")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"{where} contains {bad[:5]} outside the model's vocabulary [0, {self.vocab_size})")
        if self.context_length and len(ids) + req.params.max_new_tokens > self.context_length:
            raise InvalidRequest(
                f"{where} has {len(ids)} tokens and max_new_tokens={req.params.max_new_tokens}; together "
                f"they exceed the model's context length {self.context_length}")
        if req.return_routed_experts and self.routing is None:
            raise InvalidRequest("return_routed_experts=true but this model has no MoE router the engine records "
                                 "(Qwen3-MoE and DeepSeek-V3 routers are recorded)")
        self._validate_token_ids("sampling_params.logit_bias", [t for t, _ in req.params.logit_bias])
        self._validate_token_ids("token_ids_logprob", req.token_ids_logprob or ())

    def _validate_token_ids(self, where: str, ids) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"{where} names token ids {bad[:5]} outside the model's vocabulary "
                                 f"[0, {self.vocab_size})")

    def load(self) -> dict:
        """Queued and running requests and their prompt tokens (SGLang's /get_load counts KV tokens;
        this engine holds KV only inside a batch, so the prompts are the lasting measure)."""
        with self._cond:
            queued, running = list(self._queue), list(self._running)
        tokens = sum(len(r.input_ids) for r in queued + running)
        return {"num_reqs": len(queued) + len(running), "num_waiting_reqs": len(queued), "num_tokens": tokens}

    def submit(self, requests: list[GenerationRequest]) -> list[concurrent.futures.Future]:
        """Queue requests (validated first, all or none); they are taken in order, together if they fit."""
        for req in requests:
            self.validate(req)
        with self._cond:
            if self._closed:
                raise RuntimeError("the generation engine is shut down")
            if not self._weights_resident or self._unfilled:
                raise WeightsUnavailable(self._weights_state_message())
            self._queue.extend(requests)
            self._cond.notify_all()
        return [r.future for r in requests]

    def abort(self, rid: str | None = None, abort_all: bool = False,
              message: str = "aborted by /abort_request") -> int:
        """Abort queued and running requests by rid (or the caller's rid of an n>1 group) or all."""
        with self._cond:
            def matches(r: GenerationRequest) -> bool:
                return abort_all or rid in (r.rid, r.group_rid)

            queued = [r for r in self._queue if matches(r)]
            for req in queued:
                self._queue.remove(req)
            running = [r.rid for r in self._running if matches(r)]
            self._abort_rids.update(dict.fromkeys(running, message))
            self._cond.notify_all()
        for req in queued:  # never started: finish with no tokens
            self._resolve(_Row(req, self._generator), {"type": "abort", "message": message})
        return len(queued) + len(running)

    def pause(self, mode: str = "abort") -> None:
        """abort: finish every request with finish_reason abort, then pause. in_place / retract:
        the running batch halts between forward steps and resumes on continue_generation."""
        if mode not in ("abort", "in_place", "retract"):
            raise InvalidRequest(f"mode={mode!r} must be one of 'abort', 'in_place', 'retract'")
        if mode == "abort":
            self.abort(abort_all=True, message="aborted by /pause_generation")
        with self._cond:
            self._paused = True

    def resume_generation(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def pending(self) -> int:
        """Requests queued or still generating. A request whose answer is already out counts as
        done although its batch is still being cleaned up: a client that has every answer and
        asks to flush the cache at once must not be refused (seen under load in CI)."""
        with self._cond:
            return len(self._queue) + sum(not r.future.done() for r in self._running)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def weights_ready(self) -> bool:
        return self._weights_resident and not self._unfilled

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _collect_eos_ids(self) -> frozenset[int]:
        values = (getattr(self.model.config, "eos_token_id", None), self.tokenizer.eos_token_id,
                  getattr(getattr(self.model, "generation_config", None), "eos_token_id", None))
        return frozenset(v for value in values for v in (value if isinstance(value, (list, tuple)) else [value])
                         if v is not None)

    # ---- scheduler ------------------------------------------------------------------------------
    def _scheduler_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._queue or self._paused or not self.weights_ready):
                    self._cond.wait()
                if self._closed:
                    break
                batch = [self._queue.popleft() for _ in range(min(self.max_batch_size, len(self._queue)))]
                self._running = batch
            try:
                with torch.inference_mode():
                    self._run_batch(batch)
            except Exception as exc:  # a failed batch fails its callers, the engine keeps serving
                log.exception("generation batch of %d requests failed", len(batch))
                for req in batch:
                    if not req.future.done():
                        req.future.set_exception(RuntimeError(f"generation failed: {exc!r}"))
            finally:
                with self._cond:
                    self._running = []
                    self._abort_rids.clear()
        with self._cond:
            for req in self._queue:
                req.future.set_exception(RuntimeError("the generation engine shut down"))
            self._queue.clear()

    def _run_batch(self, requests: list[GenerationRequest]) -> None:
        self.stats["batches"] += 1
        self.stats["max_rows"] = max(self.stats["max_rows"], len(requests))
        rows = [_Row(r, self._generator) for r in requests]
        ids, mask = self._left_pad([r.input_ids for r in requests])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        want_input_lp = any(r.return_logprob and r.logprob_start_len >= 0 for r in requests)
        routing = BatchCapture.start(self.routing, rows)  # None unless a row asked for its experts
        out = self._forward(ids, mask, positions, self.runner.new_cache(), keep_all=want_input_lp)
        if routing is not None:
            routing.prefill(ids.shape[1])
        if want_input_lp:
            self._fill_input_logprobs(rows, out.logits, ids)
        batch = _Batch(list(range(len(rows))), out.past_key_values, mask, positions)
        last_logits = out.logits[:, -1]
        for row in rows:
            if row.req.params.max_new_tokens == 0:
                self._resolve(row, {"type": "length", "length": 0})
        while True:
            self._finish_aborted(rows, batch.active)
            live = [k for k, i in enumerate(batch.active) if rows[i].finish is None]
            if live:
                self._sample_into_rows(rows, [batch.active[k] for k in live], last_logits[live])
            while True:  # between forward steps: honour pause, released weights and aborts
                batch.keep_unfinished(rows, self.device)
                if not batch.active:
                    return
                if self._wait_until_runnable(rows, batch.active):
                    break
                self._finish_aborted(rows, batch.active)
            next_ids = torch.tensor([[rows[i].output_ids[-1]] for i in batch.active], device=self.device)
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.active), 1)], dim=1)
            batch.positions = batch.positions[:, -1:] + 1
            out = self._forward(next_ids, batch.mask, batch.positions, batch.cache, keep_all=False)
            if routing is not None:
                routing.decode(batch.active)
            last_logits = out.logits[:, -1]

    def _forward(self, ids, mask, positions, cache, keep_all: bool):
        while True:  # weights may be released between the caller's check and this lock
            with self._model_lock:
                if self.weights_ready:
                    self.stats["forward_steps"] += 1
                    return self.runner.forward(ids, mask, positions, cache, keep_all)
            with self._cond:
                while not self.weights_ready and not self._closed:
                    self._cond.wait()
                if self._closed:
                    raise RuntimeError("the engine shut down while weights were released")

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        return ids.to(self.device), mask.to(self.device)

    def _fill_input_logprobs(self, rows: list[_Row], logits: torch.Tensor, ids: torch.Tensor) -> None:
        fill_input_logprobs(rows, logits, ids)

    def _sample_into_rows(self, rows: list[_Row], indices: list[int], logits: torch.Tensor) -> None:
        requests = [rows[i].req for i in indices]
        params = [r.params for r in requests]
        logits = process_logits(logits.float(), params, [rows[i].output_ids for i in indices], self.eos_token_ids)
        tokens, logprobs = sample_next_tokens(
            logits, [p.temperature for p in params], [p.top_p for p in params],
            [p.top_k for p in params], [rows[i].generator for i in indices], min_ps=[p.min_p for p in params])
        for i, step in zip(indices, token_steps(logits, requests, tokens.tolist(), logprobs.tolist())):
            rows[i].record(step)
            finish = self._stop_reason(rows[i])
            if finish is not None:
                self._resolve(rows[i], finish)

    def _stop_reason(self, row: _Row) -> dict | None:
        return stop_reason(row, self.eos_token_ids, self.decode)

    def _finish_aborted(self, rows: list[_Row], active: list[int]) -> None:
        with self._cond:
            closing = self._closed
            aborted = {i: "the engine is shutting down" if closing else self._abort_rids[rows[i].req.rid]
                       for i in active if rows[i].finish is None
                       and (closing or rows[i].req.rid in self._abort_rids)}
        for i, message in aborted.items():
            self._resolve(rows[i], {"type": "abort", "message": message})

    def _wait_until_runnable(self, rows: list[_Row], active: list[int]) -> bool:
        """Block while paused or weights are missing; False when an active row was aborted meanwhile."""
        with self._cond:
            while True:
                if self._closed or any(rows[i].req.rid in self._abort_rids for i in active):
                    return False
                if not self._paused and self.weights_ready:
                    return True
                self._cond.wait()

    def _resolve(self, row: _Row, finish: dict) -> None:
        req, result = row.req, finished_result(row, finish, self.decode, self.weight_version)
        self.stats["requests_finished"] += 1
        if not req.future.done():
            req.future.set_result(result)
