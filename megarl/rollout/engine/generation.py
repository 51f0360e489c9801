"""The embedded rollout engine: a Hugging Face causal LM behind a continuous-batching scheduler thread.

Requests queue up; the scheduler (scheduler.py) prefills queued requests and merges them into the
running batch at the next step, up to `max_batch_size` rows, and drops rows as soon as they
finish (their callers are answered at once). Aborts, pauses (abort / in_place / retract) and
released weights are honoured between forward steps.

The model sits behind a runner (runner/runners.py): loaded in this process, or sharded over the ranks
of a tensor-parallel mesh of which this process is rank 0. A vision-language model (Qwen2.5-VL,
tp=1) also takes prompts with images: `attach_images` expands and processes them (vision.py).

Weights change only between forward steps (`_model_lock`), so a running batch may continue with
new weights, as SGLang's in-place pause does (weights.py: updates, staging, release); each
token records the weight_version it was produced with. Log-probs follow megarl's contract:
log_softmax(logits / temperature) over the full vocabulary; temperature 0 is greedy with
log-probs of the raw logits. A request's penalties, logit_bias and min_new_tokens change the
logits first (logit_processing.py says how); its log-probs are then those of the changed logits,
as in SGLang.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading

import torch

from megarl.models.hf_names import checkpoint_renamer
from megarl.rollout.engine.lora import EngineLora
from megarl.rollout.engine.protocol import GenerationRequest, InvalidRequest, WeightsUnavailable
from megarl.rollout.engine.rows import Row as _Row
from megarl.rollout.engine.rows import finished_result
from megarl.rollout.engine.runner.runners import LocalRunner
from megarl.rollout.engine.scheduler import Scheduler
from megarl.rollout.engine.vision import VisionInputs
from megarl.rollout.engine.weights import EngineWeights
from megarl.wire.routing import RoutingRecorder

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "in_place", "retract")


class GenerationEngine(EngineWeights, EngineLora, Scheduler):
    def __init__(
        self,
        model_path: str,
        tokenizer_path: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 32,
        seed: int | None = None,
        runner=None,
        continuous_batching: bool = True,
    ):
        """`runner`: the model's ranks (megarl.rollout.engine.runner.runners.TPRunner for --tp > 1); by default
        the model is loaded into this process (LocalRunner). `continuous_batching=False`: a batch
        runs to completion before queued requests start (the engine before continuous batching)."""
        from transformers import AutoTokenizer

        self.model_path, self.tokenizer_path = str(model_path), str(tokenizer_path or model_path)
        self.device, self.dtype, self.max_batch_size = torch.device(device), dtype, max_batch_size
        self.continuous_batching = continuous_batching
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
        self._rename = checkpoint_renamer(self.model)  # checkpoint name -> the model's (hf_names.py)
        self.vision = VisionInputs.of(self.model, self.model_path)  # None: a text model
        self._unfilled: set[str] = set()  # params re-allocated by resume, awaiting an update
        self._weights_resident = True
        self._generator = torch.Generator()
        self._generator.manual_seed(seed) if seed is not None else self._generator.seed()
        self._model_lock = threading.Lock()  # held for each forward and each weight write
        self._tokenizer_lock = threading.Lock()  # fast tokenizers dislike concurrent use
        self._backend = plain_fast_backend(self.tokenizer)
        self._clean_up = bool(getattr(self.tokenizer, "clean_up_tokenization_spaces", False))
        self._cond = threading.Condition()  # guards the queue, pause, abort and weight state
        self._queue: collections.deque[_Row] = collections.deque()  # waiting, retracted ones first
        self._running: list[_Row] = []  # the rows of the running batch and those being prefilled
        self._paused, self._pause_mode = False, None
        self._quiet = True  # the scheduler is between forward steps and waiting (pause() waits for it)
        self._closed = False
        # batches (started from an empty engine), forward_steps, requests_finished, max_rows (rows
        # running at once, counting those being prefilled to join), joined (requests that joined
        # a running batch), retracted (rows retracted by a pause)
        self.stats = collections.Counter()
        self._thread = threading.Thread(target=self._scheduler_loop, name="rollout-engine", daemon=True)
        self._thread.start()

    # ---- requests -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            return self.tokenizer.encode(text)  # special tokens added as SGLang does

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        with self._tokenizer_lock:  # the spaces flag matters to slow tokenizers; fast ones ignore it
            if self._backend is not None:  # what the fast tokenizer's decode does, minus its to_py_obj
                text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
                return self.tokenizer.clean_up_tokenization(text) if self._clean_up else text
            return self.tokenizer.decode(
                ids,
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
            )

    def attach_images(
        self, input_ids: list[int], images: list, prompt: str = "input_ids", names: list[str] | None = None
    ) -> tuple[list[int], object | None]:
        """(the prompt's ids with each image's pad expanded, its PromptImages for
        GenerationRequest.images) of a prompt with one `<|image_pad|>` per image (vision.py);
        InvalidRequest naming `prompt` or the image (`names[k]`) when they do not pair up or an
        image does not decode, or when the model has no vision tower."""
        if self.vision is None:
            if not images:
                return input_ids, None
            raise InvalidRequest(
                f"image_data: this model ({self.model.config.model_type}) has no vision tower; send "
                "images only to a vision-language model (Qwen2.5-VL)"
            )
        return self.vision.prepare(input_ids, images, prompt, names)

    def validate(self, req: GenerationRequest, where: str = "input_ids") -> None:
        ids = req.input_ids
        if not ids:
            raise InvalidRequest(f"{where} is empty; a prompt needs at least one token")
        if self.vision is not None and req.images is None and self.vision.spec.image_token_id in ids:
            raise InvalidRequest(
                f"{where} holds image pads (id {self.vision.spec.image_token_id}) but the request has "
                "no images: send its images in image_data, one per pad"
            )
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"{where} contains {bad[:5]} outside the model's vocabulary [0, {self.vocab_size})")
        if self.context_length and len(ids) + req.params.max_new_tokens > self.context_length:
            raise InvalidRequest(
                f"{where} has {len(ids)} tokens and max_new_tokens={req.params.max_new_tokens}; together "
                f"they exceed the model's context length {self.context_length}"
            )
        if req.return_routed_experts and self.routing is None:
            raise InvalidRequest(
                "return_routed_experts=true but this model has no MoE router the engine records "
                "(Qwen3-MoE and DeepSeek-V3 routers are recorded)"
            )
        self._validate_token_ids("sampling_params.logit_bias", [t for t, _ in req.params.logit_bias])
        self._validate_token_ids("token_ids_logprob", req.token_ids_logprob or ())

    def _validate_token_ids(self, where: str, ids) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"{where} names token ids {bad[:5]} outside the model's vocabulary [0, {self.vocab_size})"
            )

    def load(self) -> dict:
        """Queued and running requests and their tokens (prompt + output so far: what a running
        row holds in the KV cache, what a queued one will)."""
        with self._cond:
            queued, running = list(self._queue), list(self._running)
        tokens = sum(len(r.req.input_ids) + len(r.output_ids) for r in queued + running)
        return {"num_reqs": len(queued) + len(running), "num_waiting_reqs": len(queued), "num_tokens": tokens}

    def submit(self, requests: list[GenerationRequest]) -> list[concurrent.futures.Future]:
        """Queue requests (validated first, all or none); they are taken in order, joining the
        running batch while it has room."""
        for req in requests:
            self.validate(req)
        with self._cond:
            if self._closed:
                raise RuntimeError("the generation engine is shut down")
            if not self._weights_resident or self._unfilled:
                raise WeightsUnavailable(self._weights_state_message())
            self._queue.extend(_Row(req, self._generator) for req in requests)
            self._cond.notify_all()
        return [r.future for r in requests]

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted by /abort_request") -> int:
        """Abort queued and running requests by rid (or the caller's rid of an n>1 group) or all.
        A queued one is answered here (with the tokens it has, if it was retracted); a running one
        by the scheduler before its next forward step."""
        with self._cond:

            def matches(row: _Row) -> bool:
                return abort_all or rid in (row.req.rid, row.req.group_rid)

            queued = [r for r in self._queue if matches(r)]
            for row in queued:
                self._queue.remove(row)
            running = [r for r in self._running if matches(r) and r.finish is None]
            for row in running:
                row.abort_message = message
            self._cond.notify_all()
        for row in queued:
            self._resolve(row, {"type": "abort", "message": message})
        return len(queued) + len(running)

    def pause(self, mode: str = "abort") -> None:
        """abort: finish every request with finish_reason abort, then pause. in_place: the running
        batch halts between forward steps, keeping its KV cache. retract: its rows go back to the
        queue and their KV cache is freed; after continue_generation they are prefilled again with
        prompt + output so far, under the weights loaded then. Returns once no forward step is
        running (aborted rows answered, retracted rows queued), except on the engine's own thread
        (an on_token callback), where it only asks."""
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"mode={mode!r} must be one of {', '.join(map(repr, PAUSE_MODES))}")
        if mode == "abort":
            self.abort(abort_all=True, message="aborted by /pause_generation")
        with self._cond:
            self._paused, self._pause_mode = True, mode
            self._cond.notify_all()
            if threading.current_thread() is not self._thread:
                while not (self._quiet or self._closed) and self._thread.is_alive():
                    self._cond.wait(timeout=1.0)

    def resume_generation(self) -> None:
        with self._cond:
            self._paused, self._pause_mode = False, None
            self._cond.notify_all()

    def pending(self) -> int:
        """Requests queued or still generating. A request whose answer is already out counts as
        done although its batch is still being cleaned up: a client that has every answer and
        asks to flush the cache at once must not be refused (seen under load in CI)."""
        with self._cond:
            return len(self._queue) + sum(not r.req.future.done() for r in self._running)

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
        log.info("engine counters at shutdown: %s", dict(sorted(self.stats.items())))

    def _collect_eos_ids(self) -> frozenset[int]:
        values = (
            getattr(self.model.config, "eos_token_id", None),
            self.tokenizer.eos_token_id,
            getattr(getattr(self.model, "generation_config", None), "eos_token_id", None),
        )
        return frozenset(
            v for value in values for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None
        )

    def _resolve(self, row: _Row, finish: dict) -> None:
        req, result = row.req, finished_result(row, finish, self.decode, self.weight_version)
        self.stats["requests_finished"] += 1
        if not req.future.done():
            req.future.set_result(result)


def plain_fast_backend(tokenizer):
    """The `tokenizers` backend of a fast tokenizer whose decode is transformers' own (no subclass
    overrides it), else None. Such a decode is the backend's decode plus the optional space
    clean-up; transformers first runs each id list through `to_py_obj`, which took 6% of the
    engine's samples in a quickstart step (256 rows decoded a step), for nothing on a list of ints."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
    ):
        return tokenizer.backend_tokenizer
    return None
