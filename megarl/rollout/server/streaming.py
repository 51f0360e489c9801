"""stream=true for /generate: SGLang's server-sent events.

Each event is `data: {json}\\n\\n`; the last is `data: [DONE]\\n\\n`. Chunks are cumulative, as
SGLang's default (incremental_streaming_output off) sends them: every chunk carries the text,
output_ids and output-side log-prob fields of the whole output so far; the final chunk of a
request is exactly the non-streamed answer item (with finish_reason and e2e_latency). A batched
or n > 1 request interleaves its requests' chunks, each tagged with "index", its position in the
prompt-major answer list, as SGLang's batch streaming does. sampling_params.stream_interval sends
one chunk per that many tokens. When the client reads slower than tokens arrive, queued progress
is folded into one chunk (SGLang does the same), so the text is decoded once per chunk sent.

A client that goes away aborts its unfinished requests: when a send fails (the generator is
closed) and, while nothing is being sent (queued or paused requests), by polling for a disconnect.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request

from megarl.rollout.engine.protocol import GenerationRequest, GenerationResult, TokenStep
from megarl.rollout.engine.rows import run_lengths
from megarl.rollout.server.generate_input import GenerateCall

DISCONNECT_POLL_S = 0.5
DONE = b"data: [DONE]\n\n"

ItemOf = Callable[[GenerationResult, GenerationRequest], dict]


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class _Progress:
    """What one request has streamed so far."""

    def __init__(self, req: GenerationRequest):
        self.req, self.steps, self.sent, self.result = req, [], 0, None

    def due(self) -> bool:
        interval = self.req.params.stream_interval
        return self.result is None and len(self.steps) // interval > self.sent // interval

    def snapshot(self, engine) -> GenerationResult:
        req, p = self.req, self.req.params
        ids = [s.token for s in self.steps]
        logprob = req.return_logprob
        return GenerationResult(
            rid=req.rid,
            text=engine.decode(ids, p.skip_special_tokens, p.spaces_between_special_tokens),
            input_ids=req.input_ids,
            output_ids=ids,
            output_logprobs=[s.logprob for s in self.steps] if logprob else None,
            input_logprobs=None,
            finish_reason=None,
            prompt_tokens=len(req.input_ids),
            weight_version=engine.weight_version,
            e2e_latency=0.0,
            output_top_logprobs=[s.top_logprobs for s in self.steps] if logprob and req.top_logprobs_num else None,
            output_token_ids_logprobs=(
                [s.token_ids_logprobs for s in self.steps] if logprob and req.token_ids_logprob else None
            ),
            output_entropy=[s.entropy for s in self.steps] if req.return_entropy else None,
            weight_versions=run_lengths([s.weight_version for s in self.steps]),
        )


class GenerationStream:
    """Hooks a call's requests and submits them (errors raise here, before any byte is sent);
    `events` then yields the SSE body."""

    def __init__(self, call: GenerateCall, engine, item_of: ItemOf):
        self._call, self._engine, self._item_of = call, engine, item_of
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._progress = [_Progress(req) for req in call.requests]
        self._failed = False
        for k, req in enumerate(call.requests):
            req.on_token = self._forwarder(k)
            req.future.add_done_callback(self._forwarder(k))
        engine.submit(call.requests)

    def _forwarder(self, k: int):
        """Engine thread -> event loop: a TokenStep, or the finished future."""

        def forward(item) -> None:
            if not self._loop.is_closed():  # a closed loop (server shut down) has no reader left
                self._loop.call_soon_threadsafe(self._queue.put_nowait, (k, item))

        return forward

    async def events(self, request: Request) -> AsyncIterator[bytes]:
        try:
            while not self._failed and any(p.result is None for p in self._progress):
                try:
                    first = await asyncio.wait_for(self._queue.get(), timeout=DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                for chunk in self._apply([first, *self._drain()]):
                    yield chunk
            yield DONE
        finally:
            self._abort_unfinished()

    def _drain(self) -> list:
        items = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items

    def _apply(self, items: list) -> list[bytes]:
        """Fold queued progress into the requests' state; one chunk per request that is due."""
        touched: dict[int, None] = {}
        for k, item in items:
            progress = self._progress[k]
            if isinstance(item, TokenStep):
                progress.steps.append(item)
            else:
                progress.result = _result_or_error(item)
            touched[k] = None
        chunks = []
        for k in touched:
            progress = self._progress[k]
            if isinstance(progress.result, Exception):  # SGLang's in-stream error event, then [DONE]
                self._failed = True
                return chunks + [sse({"error": {"message": str(progress.result)}})]
            if progress.result is not None:
                chunks.append(self._chunk(k, progress.result))
            elif progress.due():
                progress.sent = len(progress.steps)
                chunks.append(self._chunk(k, progress.snapshot(self._engine)))
        return chunks

    def _chunk(self, k: int, result: GenerationResult) -> bytes:
        item = self._item_of(result, self._call.requests[k])
        if not self._call.single:
            item["index"] = k
        return sse(item)

    def _abort_unfinished(self) -> None:
        for progress in self._progress:
            if progress.result is None and not progress.req.future.done():
                self._engine.abort(progress.req.rid, message="client disconnected")


def _result_or_error(future: concurrent.futures.Future):
    exc = future.exception()
    return exc if exc is not None else future.result()
