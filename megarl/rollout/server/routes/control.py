"""Control and inspection endpoints: health, model and server info, load, the parallel layout,
/abort_request, /pause_generation and /continue_generation, /flush_cache.

Their answers are SGLang 0.5's shapes: health probes answer an empty 200 or a 503, control calls
{"success", "message"} (http_common.control), /flush_cache plain text (400 while requests run).
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, Response

from megarl.rollout.engine.protocol import GenerationRequest, SamplingParams
from megarl.rollout.server.http_common import control, field, read_body
from megarl.rollout.server.state import engine_of, server_of

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    alive = engine_of(request).alive
    return Response(status_code=200 if alive else 503)


@router.get("/health_generate")
async def health_generate(request: Request):
    engine = engine_of(request)
    if not engine.weights_ready or engine.paused:
        return Response("weights released or generation paused", status_code=503)
    probe = GenerationRequest(
        rid=f"health-{uuid.uuid4().hex}",
        input_ids=[engine.pad_token_id],
        params=SamplingParams(max_new_tokens=1, temperature=0.0),
    )
    try:
        await asyncio.wait_for(asyncio.wrap_future(engine.submit([probe])[0]), timeout=60)
    except Exception as exc:  # noqa: BLE001  (any failure is "unhealthy", reported)
        return Response(f"generation failed: {exc!r}", status_code=503)
    return Response(status_code=200)


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request):
    engine = engine_of(request)
    config = engine.model.config
    return {
        "model_path": engine.model_path,
        "tokenizer_path": engine.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
    }


@router.get("/get_load")
async def get_load(request: Request):
    """SGLang 0.5's shape: one entry per data-parallel rank (this server has one)."""
    return [{"dp_rank": 0, **engine_of(request).load()}]


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request):
    # The ServerArgs fields SGLang clients read (slime checks tp/dp/pp/ep sizes and
    # enable_memory_saver of an external engine) next to this server's own state.
    server = server_of(request)
    engine, server_args = server.engine, server.server_args
    return {
        **server_args,
        "model_path": engine.model_path,
        "version": "megarl-embedded",
        "tp_size": getattr(engine.runner, "tp_size", 1),
        "dp_size": 1,
        "pp_size": 1,
        "ep_size": 1,
        "nnodes": getattr(engine.runner, "nnodes", 1),
        "node_rank": 0,
        "enable_memory_saver": True,
        "random_seed": server_args.get("seed"),
        "context_length": engine.context_length,
        "max_running_requests": engine.max_batch_size,
        "weight_version": engine.weight_version,
        "max_batch_size": engine.max_batch_size,
        "device": str(engine.device),
        "dtype": engine.dtype,
        "paused": engine.paused,
        "weights_ready": engine.weights_ready,
        "pending_requests": engine.pending(),
        "engine_stats": dict(engine.stats),
    }


@router.get("/get_parallelism_config")
async def get_parallelism_config(request: Request):
    """Which slice of each full HF tensor every rank holds (shape: runner/sharding.py parameter_layout)."""
    return engine_of(request).runner.layout()


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    await read_body(request)  # none expected; a malformed one is refused like everywhere else
    pending = engine_of(request).pending()
    if pending:
        return PlainTextResponse(f"Cache not flushed: {pending} requests are queued or running.", 400)
    return PlainTextResponse("Cache flushed. (The embedded engine keeps no KV cache between batches.)")


@router.post("/abort_request")
async def abort_request(request: Request):
    body = await read_body(request)
    rid, abort_all = field(body, "rid", "string"), field(body, "abort_all", "boolean", False)
    engine_of(request).abort(
        rid, abort_all=abort_all, message=field(body, "abort_message", "string") or "aborted by /abort_request"
    )
    return Response(status_code=200)


@router.api_route("/pause_generation", methods=["GET", "POST"])
async def pause_generation(request: Request):
    mode = field(await read_body(request), "mode", "string", "abort")
    await run_in_threadpool(engine_of(request).pause, mode)  # returns once no forward step is running
    return control(True, f"Generation paused (mode={mode}).")


@router.api_route("/continue_generation", methods=["GET", "POST"])
async def continue_generation(request: Request):
    await read_body(request)
    engine_of(request).resume_generation()
    return control(True, "Generation continued.")
