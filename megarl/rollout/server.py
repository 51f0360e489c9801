"""The embedded rollout server: SGLang's HTTP API in front of `GenerationEngine`.

    python -m megarl.rollout.server --model-path DIR [--host 127.0.0.1] [--port 30000]
        [--max-batch-size 32] [--seed S] [--device cpu] [--dtype float32] [--torch-threads N]
        [--tp N [--nnodes K --node-rank R --dist-init-addr HOST:PORT]]   (tp/launch.py)

Request and response shapes are SGLang 0.5's (see shared/reference/sglang-http-api.md), so the
same client, router and tests work against both servers. Batched /generate with n>1 answers a
flat list of len(prompts) * n outputs in prompt-major order ([p0s0, p0s1, ..., p1s0, ...]): this
is what SGLang's TokenizerManager._handle_batch_request does (for each prompt, for each of n
samples), and a single prompt with n>1 becomes a batch of one, so it also answers a list.

Errors are SGLang's: {"error": {"message": ...}} with 400 for a malformed /generate (the message
names the field), 503 while weights are released; control endpoints answer
{"success": false, "message": ...} with 400. `/update_weights_from_tensor` unpickles its payload,
which can run code: like SGLang, bind only to interfaces that trusted processes can reach.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from megarl.rollout.engine import GenerationEngine
from megarl.rollout.protocol import (GenerationRequest, GenerationResult, InvalidRequest, SamplingParams,
                                     WeightsUnavailable)
from megarl.rollout.tp import launch

log = logging.getLogger(__name__)

_SUPPORTED_SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
                       "ignore_eos", "skip_special_tokens", "no_stop_trim", "sampling_seed", "n"}
# SGLang parameters this engine does not implement: accepted only at their no-op values.
_NO_OP_SAMPLING = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                   "repetition_penalty": 1.0, "min_new_tokens": 0, "spaces_between_special_tokens": True,
                   "json_schema": None, "regex": None, "ebnf": None, "stop_regex": None,
                   "structural_tag": None, "logit_bias": None, "custom_params": None}
_NO_OP_GENERATE = {"stream": False, "top_logprobs_num": 0, "token_ids_logprob": None,
                   "return_hidden_states": False, "return_routed_experts": False, "lora_path": None,
                   "image_data": None, "video_data": None, "audio_data": None, "input_embeds": None,
                   "custom_logit_processor": None, "return_prompt_token_ids": False}
_GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                    "return_text_in_logprobs", "priority", *_NO_OP_GENERATE}
_GREEDY_BELOW = 1e-6  # temperatures this small are greedy, as in SGLang


class _ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# ---- request parsing ------------------------------------------------------------------------------
def _integer(value, where: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not (isinstance(value, int) or isinstance(value, float) and value.is_integer()):
        raise InvalidRequest(f"{where}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise InvalidRequest(f"{where}={value!r} must be >= {minimum}")
    return int(value)


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{where}={value!r} must be a number")
    return float(value)


def _flag(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{where}={value!r} must be true or false")
    return value


def parse_sampling_params(raw: dict | None, where: str = "sampling_params") -> tuple[SamplingParams, int]:
    """SGLang sampling_params dict -> (SamplingParams, n); InvalidRequest names the bad key."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} must be an object, got {type(raw).__name__}")
    for key, value in raw.items():
        if key in _NO_OP_SAMPLING:
            if value is not None and value != _NO_OP_SAMPLING[key]:
                raise InvalidRequest(f"{where}.{key}={value!r} is not supported by the embedded rollout "
                                     f"server (only {_NO_OP_SAMPLING[key]!r}); supported: {sorted(_SUPPORTED_SAMPLING)}")
        elif key not in _SUPPORTED_SAMPLING:
            raise InvalidRequest(f"{where}.{key} is not a sampling parameter; supported: {sorted(_SUPPORTED_SAMPLING)}")
    get = lambda key, default: default if raw.get(key) is None else raw[key]  # noqa: E731
    temperature = _number(get("temperature", 1.0), f"{where}.temperature")
    top_p = _number(get("top_p", 1.0), f"{where}.top_p")
    top_k = _integer(get("top_k", -1), f"{where}.top_k", minimum=-1)
    if temperature < 0:
        raise InvalidRequest(f"{where}.temperature={temperature} must be >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"{where}.top_p={top_p} must be in (0, 1]")
    stop = get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest(f"{where}.stop={raw.get('stop')!r} must be a non-empty string or a list of them")
    stop_ids = get("stop_token_ids", [])
    if not isinstance(stop_ids, list):
        raise InvalidRequest(f"{where}.stop_token_ids={stop_ids!r} must be a list of token ids")
    seed = raw.get("sampling_seed")
    params = SamplingParams(
        max_new_tokens=_integer(get("max_new_tokens", 128), f"{where}.max_new_tokens", minimum=0),
        temperature=0.0 if temperature < _GREEDY_BELOW else temperature, top_p=top_p, top_k=top_k,
        stop=tuple(stop),
        stop_token_ids=frozenset(_integer(t, f"{where}.stop_token_ids[]", minimum=0) for t in stop_ids),
        ignore_eos=_flag(get("ignore_eos", False), f"{where}.ignore_eos"),
        skip_special_tokens=_flag(get("skip_special_tokens", True), f"{where}.skip_special_tokens"),
        no_stop_trim=_flag(get("no_stop_trim", False), f"{where}.no_stop_trim"),
        sampling_seed=None if seed is None else _integer(seed, f"{where}.sampling_seed"))
    return params, _integer(get("n", 1), f"{where}.n", minimum=1)


def _per_prompt(value, count: int, name: str, default) -> list:
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise InvalidRequest(f"{name} has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


def _prompts(body: dict, engine: GenerationEngine) -> tuple[list[list[int]], bool]:
    """-> (token ids per prompt, whether the request was a single prompt)."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise InvalidRequest("give exactly one of 'text' or 'input_ids'")
    if text is not None:
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidRequest("text must be a string or a non-empty list of strings")
        return [engine.encode(t) for t in texts], isinstance(text, str)
    if not isinstance(input_ids, list) or not input_ids:
        raise InvalidRequest("input_ids must be a non-empty list of token ids or a list of such lists")
    if all(isinstance(p, list) for p in input_ids):
        return input_ids, False
    if any(isinstance(p, list) for p in input_ids):
        raise InvalidRequest("input_ids mixes token ids and lists; give list[int] or list[list[int]]")
    return [input_ids], True


def parse_generate(body: Any, engine: GenerationEngine) -> tuple[list[GenerationRequest], bool, bool]:
    """SGLang GenerateReqInput -> (engine requests in prompt-major order, single response?, token text?)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for key, value in body.items():
        if key not in _GENERATE_FIELDS:
            raise InvalidRequest(f"'{key}' is not a /generate field this server knows")
        if key in _NO_OP_GENERATE and value not in (None, _NO_OP_GENERATE[key]):
            raise InvalidRequest(f"{key}={value!r} is not supported by the embedded rollout server")
    prompts, single = _prompts(body, engine)
    count, raw_params = len(prompts), body.get("sampling_params")
    if isinstance(raw_params, list) and single:
        raise InvalidRequest("sampling_params is a list but the request has a single prompt")
    parsed = [parse_sampling_params(p, f"sampling_params[{i}]" if isinstance(raw_params, list) else "sampling_params")
              for i, p in enumerate(_per_prompt(raw_params, count, "sampling_params", None))]
    n = parsed[0][1]
    if any(k != n for _, k in parsed):
        raise InvalidRequest("sampling_params.n must be the same for every prompt (as in SGLang)")
    rids = _per_prompt(body.get("rid"), count, "rid", None)
    return_lp = _per_prompt(body.get("return_logprob"), count, "return_logprob", False)
    start = _per_prompt(body.get("logprob_start_len"), count, "logprob_start_len", -1)
    requests = []
    for i, (ids, (params, _)) in enumerate(zip(prompts, parsed)):
        where = "input_ids" if single else f"input_ids[{i}]"
        base = str(rids[i]) if rids[i] is not None else uuid.uuid4().hex
        for j in range(n):
            req = GenerationRequest(
                rid=base if n == 1 else f"{base}-{j}", input_ids=ids, params=params,
                return_logprob=_flag(return_lp[i], "return_logprob"),
                logprob_start_len=_integer(start[i], "logprob_start_len", minimum=-1),
                group_rid=base if n > 1 else None)
            engine.validate(req, where)
            requests.append(req)
    return requests, single and n == 1, bool(body.get("return_text_in_logprobs", False))


def result_to_json(result: GenerationResult, engine: GenerationEngine, token_text: bool) -> dict:
    meta = {"id": result.rid, "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.output_ids), "cached_tokens": 0,
            "weight_version": result.weight_version, "num_retractions": 0, "e2e_latency": result.e2e_latency}

    def triples(logprobs, ids):
        return [[lp, t, engine.decode([t], False) if token_text else None] for lp, t in zip(logprobs, ids)]

    if result.output_logprobs is not None:
        meta["output_token_logprobs"] = triples(result.output_logprobs, result.output_ids)
    if result.input_logprobs is not None:
        prompt = result.input_ids[len(result.input_ids) - len(result.input_logprobs):]
        meta["input_token_logprobs"] = triples(result.input_logprobs, prompt)
    return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}


# ---- the app ----------------------------------------------------------------------------------------
async def _body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return dict(request.query_params)
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise _ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _ApiError(400, "the request body must be a JSON object")
    return body


def _control(ok: bool, message: str, **extra) -> JSONResponse:
    return JSONResponse({"success": ok, "message": message, **extra}, status_code=200 if ok else 400)


def create_app(engine: GenerationEngine, server_args: dict | None = None) -> FastAPI:
    app = FastAPI(title="megarl embedded rollout server")
    app.state.engine, server_args = engine, dict(server_args or {})

    @app.exception_handler(_ApiError)
    async def _api_error(_, exc: _ApiError):
        return JSONResponse({"error": {"message": str(exc)}}, status_code=exc.status)

    @app.exception_handler(InvalidRequest)
    async def _invalid(_, exc: InvalidRequest):
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)

    @app.exception_handler(WeightsUnavailable)
    async def _unavailable(_, exc: WeightsUnavailable):
        return JSONResponse({"error": {"message": str(exc)}}, status_code=503)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        requests, single, token_text = parse_generate(await _body(request), engine)
        futures = engine.submit(requests)
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except asyncio.CancelledError:  # the client went away: stop spending compute on it
            for req in requests:
                engine.abort(req.rid, message="client disconnected")
            raise
        except RuntimeError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=500)
        outputs = [result_to_json(r, engine, token_text) for r in results]
        return outputs[0] if single else outputs

    @app.get("/health")
    async def health():
        alive = engine.alive
        return Response(status_code=200 if alive else 503)

    @app.get("/health_generate")
    async def health_generate():
        if not engine.weights_ready or engine.paused:
            return Response("weights released or generation paused", status_code=503)
        probe = GenerationRequest(rid=f"health-{uuid.uuid4().hex}", input_ids=[engine.pad_token_id],
                                  params=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            await asyncio.wait_for(asyncio.wrap_future(engine.submit([probe])[0]), timeout=60)
        except Exception as exc:  # noqa: BLE001  (any failure is "unhealthy", reported)
            return Response(f"generation failed: {exc!r}", status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        config = engine.model.config
        return {"model_path": engine.model_path, "tokenizer_path": engine.tokenizer_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": engine.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None)}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        return {**server_args, "model_path": engine.model_path, "version": "megarl-embedded",
                "weight_version": engine.weight_version, "max_batch_size": engine.max_batch_size,
                "device": str(engine.device), "dtype": engine.dtype, "paused": engine.paused,
                "weights_ready": engine.weights_ready, "pending_requests": engine.pending(),
                "engine_stats": dict(engine.stats)}

    @app.get("/get_parallelism_config")
    async def get_parallelism_config():
        """Which slice of each full HF tensor every rank holds (shape: tp/sharding.py parameter_layout)."""
        return engine.runner.layout()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        pending = engine.pending()
        if pending:
            return PlainTextResponse(f"Cache not flushed: {pending} requests are queued or running.", 400)
        return PlainTextResponse("Cache flushed. (The embedded engine keeps no KV cache between batches.)")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _body(request)
        engine.abort(body.get("rid"), abort_all=bool(body.get("abort_all", False)),
                     message=body.get("abort_message") or "aborted by /abort_request")
        return Response(status_code=200)

    @app.api_route("/pause_generation", methods=["GET", "POST"])
    async def pause_generation(request: Request):
        mode = (await _body(request)).get("mode", "abort")
        engine.pause(mode)
        return _control(True, f"Generation paused (mode={mode}).")

    @app.api_route("/continue_generation", methods=["GET", "POST"])
    async def continue_generation():
        engine.resume_generation()
        return _control(True, "Generation continued.")

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await _body(request)
        payloads = body.get("serialized_named_tensors")
        payloads = [payloads] if isinstance(payloads, str) else payloads
        if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
            return _control(False, "serialized_named_tensors must be a non-empty list of base64 strings "
                                   "(one per TP rank: rank r reads entry r; a single entry is read by every rank)")
        if body.get("abort_all_requests"):
            engine.abort(abort_all=True, message="aborted for a weight update")

        def load() -> str:  # in a worker thread: waits for the model lock between forward steps
            return engine.update_weights_from_payloads(payloads, body.get("load_format"), body.get("weight_version"))

        try:
            return _control(True, await run_in_threadpool(load))
        except (ValueError, WeightsUnavailable, RuntimeError, OSError) as exc:
            return _control(False, f"update_weights_from_tensor failed: {exc}")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await _body(request)
        if not isinstance(body.get("model_path"), str):
            return _control(False, "model_path (a directory with *.safetensors) is required", num_paused_requests=0)
        if body.get("abort_all_requests"):
            engine.abort(abort_all=True, message="aborted for a weight update")
        try:
            message = await run_in_threadpool(engine.update_weights_from_disk, body["model_path"],
                                              body.get("weight_version"))
            return _control(True, message, num_paused_requests=0)
        except (ValueError, WeightsUnavailable, RuntimeError, OSError) as exc:
            return _control(False, f"update_weights_from_disk failed: {exc}", num_paused_requests=0)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await _body(request)
        if body.get("new_version") is None:
            return _control(False, "new_version is required")
        if body.get("abort_all_requests", True):
            engine.abort(abort_all=True, message="aborted by /update_weight_version")
        engine.weight_version = str(body["new_version"])
        return _control(True, f"weight_version={engine.weight_version}")

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request):
        return await _memory_occupation(request, release=True)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request):
        return await _memory_occupation(request, release=False)

    async def _memory_occupation(request: Request, release: bool):
        tags = (await _body(request)).get("tags") or ["weights", "kv_cache", "cuda_graph"]
        tags = [tags] if isinstance(tags, str) else tags
        unknown = [t for t in tags if t not in ("weights", "kv_cache", "cuda_graph")]
        if unknown:
            return _control(False, f"tags {unknown} unknown; use a subset of ['weights', 'kv_cache', 'cuda_graph']")
        messages = []
        if "weights" in tags:
            action = engine.release_weights if release else engine.resume_weights
            messages.append("weights: " + await run_in_threadpool(action))
        if "kv_cache" in tags:
            messages.append("kv_cache: nothing held; the KV cache exists only inside a running batch")
        if "cuda_graph" in tags:
            messages.append("cuda_graph: not used by the embedded engine")
        return _control(True, "; ".join(messages))

    return app


def main(argv: list[str] | None = None) -> None:
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
    parser.add_argument("--log-level", default="info")
    launch.add_mesh_arguments(parser)
    args = parser.parse_args(argv)
    try:
        spec = launch.mesh_spec(args)
        if spec.tp > 1:
            launch.validate_model(args.model_path, spec.tp)
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
        return launch.run_node(*mesh_args, host=args.host, port=args.port)
    runner, mesh = launch.start_rank0(*mesh_args) if spec.tp > 1 else (None, None)
    engine = GenerationEngine(args.model_path, args.tokenizer_path, device=args.device, dtype=args.dtype,
                              max_batch_size=args.max_batch_size, seed=args.seed, runner=runner)
    app = create_app(engine, {k: v for k, v in vars(args).items()})

    def stop() -> None:
        engine.close()
        if mesh is not None:
            mesh.shutdown(runner)  # followers exit on rank 0's word, not on a broken connection

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
