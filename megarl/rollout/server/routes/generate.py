"""/generate: SGLang's generation endpoint, answered whole or streamed as server-sent events.

The body is parsed and checked by generate_input.py (a 400 names the field), the answer items are
generate_output.py's and the stream is streaming.py's. A client that disconnects while its
requests run aborts them, so the engine stops spending compute on an answer nobody reads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse

from megarl.rollout.engine.generation import GenerationEngine
from megarl.rollout.server.generate_input import GenerateCall, parse_generate
from megarl.rollout.server.generate_output import output_item
from megarl.rollout.server.http_common import FastJSONResponse, read_body
from megarl.rollout.server.state import engine_of
from megarl.rollout.server.streaming import GenerationStream, ItemOf

router = APIRouter()


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request):
    engine = engine_of(request)
    body = await read_body(request)
    if isinstance(body, dict) and body.get("image_data") is not None:  # decoding images: off the event loop
        call = await run_in_threadpool(parse_generate, body, engine)
    else:
        call = parse_generate(body, engine)
    if call.stream:
        stream = GenerationStream(call, engine, item_of(call, engine))
        return StreamingResponse(stream.events(request), media_type="text/event-stream")
    futures = engine.submit(call.requests)
    try:
        results = await all_results(futures)
    except asyncio.CancelledError:  # the client went away: stop spending compute on it
        for req in call.requests:
            engine.abort(req.rid, message="client disconnected")
        raise
    except RuntimeError as exc:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=500)
    to_item = item_of(call, engine)
    outputs = [to_item(r, req) for r, req in zip(results, call.requests)]
    # already plain JSON types: skipping FastAPI's jsonable_encoder walk saves ~6% of a busy engine's CPU
    return FastJSONResponse(outputs[0] if call.single else outputs)


def item_of(call: GenerateCall, engine: GenerationEngine) -> ItemOf:
    """The answer item of one finished request of `call` (its text pieces decoded by the engine)."""
    return lambda result, req: output_item(result, req, call, lambda t: engine.decode([t], False))


async def all_results(futures: list[concurrent.futures.Future]) -> list:
    """The results of the engine's futures, in order, once every one is done; the first failure is
    raised as soon as it happens. The event loop is woken once for the whole batch: wrapping
    each of a 256-row batch's futures in an asyncio future (asyncio.gather of wrap_future) woke it
    once per row and cost ~20% of a busy engine's CPU, measured with py-spy."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    lock, left = threading.Lock(), [len(futures)]

    def wake(failure: BaseException | None) -> None:
        if not done.done():
            done.set_result(failure)

    def settled(future: concurrent.futures.Future) -> None:  # on the scheduler's thread
        failure = None if future.cancelled() else future.exception()
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if (last or failure is not None) and not loop.is_closed():  # closed: the server is gone
            loop.call_soon_threadsafe(wake, failure)

    for future in futures:
        future.add_done_callback(settled)
    if not futures:
        wake(None)
    failure = await done
    if failure is not None:
        raise failure
    return [f.result() for f in futures]
