"""The embedded rollout server: SGLang's HTTP API in front of `GenerationEngine`.

    python -m megarl.rollout.server --model-path DIR [--host 127.0.0.1] [--port 30000]
        [--max-batch-size 32] [--seed S] [--device cpu] [--dtype float32] [--torch-threads N]
        [--api-key KEY]   (or MEGARL_ROLLOUT_API_KEY; required unless --host is a loopback address)
        [--max-body-mb 256] [--weight-dirs DIR[,DIR]]   (or MEGARL_ROLLOUT_WEIGHT_DIRS)
        [--tp N [--nnodes K --node-rank R --dist-init-addr HOST:PORT]]   (engine/runner/mesh.py)

Request and response shapes are SGLang 0.5's (see shared/reference/sglang-http-api.md), so the
same client, router and tests work against both servers. /generate accepts every field SGLang
does (sglang_fields.py says which are honoured, which change nothing here, which are refused),
answers batched input with n>1 as a flat prompt-major list (generate_input.py), and streams
SGLang's server-sent events with stream=true (streaming.py). The weight-update endpoints (tensor,
disk, update groups, distributed, reshard, deferred commit) are routes_weights.py's.

Errors are SGLang's: {"error": {"message": ...}} with 400 for a malformed /generate (the message
names the field), 503 while weights are released, 401 without the API key, 413 for a body over
--max-body-mb (body_limit.py); control endpoints answer {"success": false, "message": ...} with
400. Weight payloads are unpickled with an allow-list of torch's rebuild functions
(megarl/wire/safe_unpickle.py), so a hostile payload runs nothing; /update_weights_from_disk reads only under
--weight-dirs (weight_dirs.py).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import uuid

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from megarl.procs.net import is_loopback
from megarl.rollout.engine.generation import GenerationEngine
from megarl.rollout.engine.protocol import GenerationRequest, InvalidRequest, SamplingParams, WeightsUnavailable
from megarl.rollout.engine.runner import mesh
from megarl.rollout.server.auth import ApiKeyMiddleware, redacted, resolve_api_key
from megarl.rollout.server.body_limit import DEFAULT_MAX_BODY_MB, MAX_BODY_FLAG, BodySizeLimitMiddleware, max_body_bytes
from megarl.rollout.server.generate_input import GenerateCall, parse_generate
from megarl.rollout.server.generate_output import output_item
from megarl.rollout.server.http_common import ApiError, FastJSONResponse, control, field, read_body
from megarl.rollout.server.routes_weights import register_weight_routes
from megarl.rollout.server.streaming import GenerationStream
from megarl.rollout.server.weight_dirs import WEIGHT_DIRS_ENV, WEIGHT_DIRS_FLAG, resolve_weight_dirs

log = logging.getLogger(__name__)
_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def create_app(
    engine: GenerationEngine,
    server_args: dict | None = None,
    api_key: str | None = None,
    *,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    weight_dirs: list[str] | None = None,
) -> FastAPI:
    """`api_key`: when set, every request except /health* and /metrics* needs the Bearer key.
    `max_body_mb`: larger request bodies get 413. `weight_dirs`: where /update_weights_from_disk
    may read (default: the engine's model directory only)."""
    app = FastAPI(title="megarl embedded rollout server")
    weight_dirs = list(weight_dirs) if weight_dirs else resolve_weight_dirs(None, engine.model_path)
    app.state.engine, server_args = (
        engine,
        redacted({**(server_args or {}), "api_key": api_key, "max_body_mb": max_body_mb, "weight_dirs": weight_dirs}),
    )
    # The last middleware added runs first: the key is checked from the headers before the body
    # limiter (or any route) reads a byte, so a keyless body of any size costs nothing.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes(max_body_mb))
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(ApiError)
    async def _api_error(_, exc: ApiError):
        return JSONResponse({"error": {"message": str(exc)}}, status_code=exc.status)

    @app.exception_handler(InvalidRequest)
    async def _invalid(_, exc: InvalidRequest):
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)

    @app.exception_handler(WeightsUnavailable)
    async def _unavailable(_, exc: WeightsUnavailable):
        return JSONResponse({"error": {"message": str(exc)}}, status_code=503)

    def item_of(call: GenerateCall):
        return lambda result, req: output_item(result, req, call, lambda t: engine.decode([t], False))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        call = parse_generate(await read_body(request), engine)
        if call.stream:
            stream = GenerationStream(call, engine, item_of(call))
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
        to_item = item_of(call)
        outputs = [to_item(r, req) for r, req in zip(results, call.requests)]
        # already plain JSON types: skipping FastAPI's jsonable_encoder walk saves ~6% of a busy engine's CPU
        return FastJSONResponse(outputs[0] if call.single else outputs)

    @app.get("/health")
    async def health():
        alive = engine.alive
        return Response(status_code=200 if alive else 503)

    @app.get("/health_generate")
    async def health_generate():
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

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
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

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.weight_version}

    @app.get("/get_load")
    async def get_load():
        """SGLang 0.5's shape: one entry per data-parallel rank (this server has one)."""
        return [{"dp_rank": 0, **engine.load()}]

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        # The ServerArgs fields SGLang clients read (slime checks tp/dp/pp/ep sizes and
        # enable_memory_saver of an external engine) next to this server's own state.
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

    @app.get("/get_parallelism_config")
    async def get_parallelism_config():
        """Which slice of each full HF tensor every rank holds (shape: runner/sharding.py parameter_layout)."""
        return engine.runner.layout()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request):
        await read_body(request)  # none expected; a malformed one is refused like everywhere else
        pending = engine.pending()
        if pending:
            return PlainTextResponse(f"Cache not flushed: {pending} requests are queued or running.", 400)
        return PlainTextResponse("Cache flushed. (The embedded engine keeps no KV cache between batches.)")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await read_body(request)
        rid, abort_all = field(body, "rid", "string"), field(body, "abort_all", "boolean", False)
        engine.abort(
            rid, abort_all=abort_all, message=field(body, "abort_message", "string") or "aborted by /abort_request"
        )
        return Response(status_code=200)

    @app.api_route("/pause_generation", methods=["GET", "POST"])
    async def pause_generation(request: Request):
        mode = field(await read_body(request), "mode", "string", "abort")
        await run_in_threadpool(engine.pause, mode)  # returns once no forward step is running
        return control(True, f"Generation paused (mode={mode}).")

    @app.api_route("/continue_generation", methods=["GET", "POST"])
    async def continue_generation(request: Request):
        await read_body(request)
        engine.resume_generation()
        return control(True, "Generation continued.")

    register_weight_routes(app, engine, weight_dirs)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request):
        return await _memory_occupation(request, release=True)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request):
        return await _memory_occupation(request, release=False)

    async def _memory_occupation(request: Request, release: bool):
        tags = (await read_body(request)).get("tags")
        tags = list(_MEMORY_TAGS) if tags is None or tags == [] else tags  # a falsy 0 or {} is not "all"
        tags = [tags] if isinstance(tags, str) else tags
        if not isinstance(tags, list):
            return control(False, f"tags must be a list of strings, a subset of {list(_MEMORY_TAGS)}")
        unknown = [t for t in tags if t not in _MEMORY_TAGS]
        if unknown:
            return control(False, f"tags {unknown} unknown; use a subset of {list(_MEMORY_TAGS)}")
        messages = []
        if "weights" in tags:
            action = engine.release_weights if release else engine.resume_weights
            messages.append("weights: " + await run_in_threadpool(action))
        if "kv_cache" in tags:
            messages.append("kv_cache: nothing held; the KV cache exists only inside a running batch")
        if "cuda_graph" in tags:
            messages.append("cuda_graph: not used by the embedded engine")
        return control(True, "; ".join(messages))

    return app


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megarl.rollout.server", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True, help="Hugging Face model directory")
    parser.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=None, help="seeds sampling of requests without sampling_seed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (prefer the MEGARL_ROLLOUT_API_KEY environment "
        "variable: a command line is visible to every user of the machine)",
    )
    parser.add_argument(
        MAX_BODY_FLAG,
        type=float,
        default=DEFAULT_MAX_BODY_MB,
        help="larger request bodies are refused with 413 (default: %(default)s MB, room above "
        "the largest weight-update and batched /generate bodies; body_limit.py says why)",
    )
    parser.add_argument(
        WEIGHT_DIRS_FLAG,
        default=None,
        metavar="DIR[,DIR]",
        help=f"the only directories /update_weights_from_disk may read (or {WEIGHT_DIRS_ENV}); "
        "default: --model-path only",
    )
    parser.add_argument("--log-level", default="info")
    mesh.add_mesh_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    args.api_key = resolve_api_key(args.api_key)
    args.weight_dirs = resolve_weight_dirs(args.weight_dirs, args.model_path)
    if not args.api_key and not is_loopback(args.host):
        # /update_weights_from_tensor maps memory the caller names and /generate spends compute:
        # a server other machines can reach must not be open to all of them.
        parser.error(
            f"--host {args.host} is reachable from other machines; set an API key (--api-key or the "
            "MEGARL_ROLLOUT_API_KEY environment variable) or bind a loopback address such as 127.0.0.1"
        )
    try:
        max_body_bytes(args.max_body_mb)
        spec = mesh.mesh_spec(args)
        if spec.tp > 1:
            mesh.validate_model(args.model_path, spec.tp)
    except ValueError as exc:
        parser.error(str(exc))
    import torch
    import uvicorn

    # TP ranks share the cores: one thread each unless told otherwise (two per rank collapse on 2 cores)
    threads = args.torch_threads or (1 if spec.tp > 1 else None)
    if threads:
        torch.set_num_threads(threads)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mesh_args = (spec, args.model_path, args.dtype, args.device, threads or 1)
    if spec.node_rank > 0:
        return mesh.run_node(*mesh_args, host=args.host, port=args.port)
    runner, tp_mesh = mesh.start_rank0(*mesh_args) if spec.tp > 1 else (None, None)
    engine = GenerationEngine(
        args.model_path,
        args.tokenizer_path,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        seed=args.seed,
        runner=runner,
    )
    app = create_app(
        engine, vars(args), api_key=args.api_key, max_body_mb=args.max_body_mb, weight_dirs=args.weight_dirs
    )

    def stop() -> None:
        engine.close()
        if tp_mesh is not None:
            tp_mesh.shutdown(runner)  # followers exit on rank 0's word, not on a broken connection

    _run_at_app_shutdown(app, stop)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        stop()


def _run_at_app_shutdown(app: FastAPI, stop) -> None:
    """Run `stop` when uvicorn shuts the app down: after a SIGTERM uvicorn re-raises the signal
    once it has stopped serving, which ends the process before a `finally` in main() runs."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            yield state
        stop()

    app.router.lifespan_context = lifespan


if __name__ == "__main__":
    main()
