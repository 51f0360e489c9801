"""The embedded rollout server: SGLang's HTTP API in front of `GenerationEngine`.

    python -m megarl.rollout.server --model-path DIR [--host 127.0.0.1] [--port 30000]
        [--max-batch-size 32] [--seed S] [--device cpu] [--dtype float32] [--torch-threads N]
        [--api-key KEY]   (or MEGARL_ROLLOUT_API_KEY; required unless --host is a loopback address)
        [--max-body-mb 256] [--weight-dirs DIR[,DIR]]   (or MEGARL_ROLLOUT_WEIGHT_DIRS)
        [--tp N [--nnodes K --node-rank R --dist-init-addr HOST:PORT]]   (engine/runner/mesh.py)

Request and response shapes are SGLang 0.5's (docs/rollout.md), so the
same client, router and tests work against both servers. /generate accepts every field SGLang
does (sglang_fields.py says which are honoured, which change nothing here, which are refused),
answers batched input with n>1 as a flat prompt-major list (generate_input.py), and streams
SGLang's server-sent events with stream=true (streaming.py). The routes are one APIRouter per
group (routes/: generate, control, weights, memory); create_app adds the middleware, the error
handlers and those routers, and hands the routes the engine through app.state (state.py). The
weight-update endpoints (tensor, disk, update groups, distributed, reshard, deferred commit) are
routes/weights.py's.

Errors are SGLang's: {"error": {"message": ...}} with 400 for a malformed /generate (the message
names the field), 503 while weights are released, 401 without the API key, 413 for a body over
--max-body-mb (body_limit.py); control endpoints answer {"success": false, "message": ...} with
400. Weight payloads are unpickled with an allow-list of torch's rebuild functions
(megarl/wire/safe_unpickle.py), so a hostile payload runs nothing; /update_weights_from_disk reads only under
--weight-dirs (weight_dirs.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from megarl.procs.net import is_loopback
from megarl.rollout.engine.generation import GenerationEngine
from megarl.rollout.engine.protocol import InvalidRequest, WeightsUnavailable
from megarl.rollout.engine.runner import mesh
from megarl.rollout.server.auth import ApiKeyMiddleware, redacted, resolve_api_key
from megarl.rollout.server.body_limit import DEFAULT_MAX_BODY_MB, MAX_BODY_FLAG, BodySizeLimitMiddleware, max_body_bytes
from megarl.rollout.server.http_common import ApiError
from megarl.rollout.server.routes import ROUTERS
from megarl.rollout.server.state import ServerState
from megarl.rollout.server.weight_dirs import WEIGHT_DIRS_ENV, WEIGHT_DIRS_FLAG, resolve_weight_dirs

log = logging.getLogger(__name__)


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
    settings = {**(server_args or {}), "api_key": api_key, "max_body_mb": max_body_mb, "weight_dirs": weight_dirs}
    app.state.server = ServerState(engine=engine, server_args=redacted(settings), weight_dirs=weight_dirs)
    # The last middleware added runs first: the key is checked from the headers before the body
    # limiter (or any route) reads a byte, so a keyless body of any size costs nothing.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes(max_body_mb))
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(InvalidRequest, _invalid_request)
    app.add_exception_handler(WeightsUnavailable, _weights_unavailable)
    for router in ROUTERS:
        app.include_router(router)
    return app


# SGLang's error answer, {"error": {"message": ...}}, for the errors a route raises
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse({"error": {"message": str(exc)}}, status_code=exc.status)


async def _invalid_request(_: Request, exc: InvalidRequest) -> JSONResponse:
    return JSONResponse({"error": {"message": str(exc)}}, status_code=400)


async def _weights_unavailable(_: Request, exc: WeightsUnavailable) -> JSONResponse:
    return JSONResponse({"error": {"message": str(exc)}}, status_code=503)


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
