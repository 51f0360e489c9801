"""The embedded server's weight endpoints.

SGLang's: /update_weights_from_tensor, /update_weights_from_disk, /get_weight_version,
/update_weight_version, /init_weights_update_group, /destroy_weights_update_group,
/update_weights_from_distributed. megarl's: /update_weights_from_reshard (each rank receives only
its own shard pieces, from many senders), /commit_weight_update and /abort_weight_update, and a
`defer` flag on the tensor, distributed and reshard updates: a deferred update is staged on every
rank and written only by the commit naming its weight_version, so a sync that fails half-way never
leaves a half-updated model (engine/runner/stage.py has the rules).

Every update answers SGLang's {"success", "message"} (200 / 400); a field of the wrong JSON type
is a 400 naming it (http_common.field), and /update_weights_from_disk reads only under the
server's allowed weight directories (weight_dirs.py; 403 naming them otherwise). Updates over a
group are received in full before they are checked, so a refusal never leaves the senders
blocked; a receive that fails (a sender died) destroys the group on every rank and says so,
naming the group.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from megarl.rollout.engine.generation import GenerationEngine
from megarl.rollout.engine.protocol import WeightsUnavailable
from megarl.rollout.server.http_common import control, field, read_body
from megarl.rollout.server.state import engine_of, server_of
from megarl.rollout.server.weight_dirs import PathNotAllowed, confine

router = APIRouter()
_FAILURES = (ValueError, WeightsUnavailable, RuntimeError, OSError)  # UpdateRejected is a ValueError
_DEFAULT_GROUP = "weight_update_group"


async def _run(what: str, call: Callable, *args, **extra) -> JSONResponse:
    """`call(*args)` in a worker thread (it waits for the model lock between forward steps),
    answered as a control result: its message, or `what` failed and why."""
    try:
        return control(True, await run_in_threadpool(call, *args), **extra)
    except _FAILURES as exc:
        return control(False, f"{what} failed: {exc}", **extra)


def _selector_problem(body: dict) -> str | None:
    """SGLang's `selector` picks the target model, its speculative draft model, or both; this
    engine has no draft model, so only the target can be meant."""
    selector = body.get("selector")
    if selector in (None, "all", "target"):
        return None
    return f"selector={selector!r}: this engine has no speculative draft model; use 'all' or 'target'"


def _abort_requests_if_asked(
    engine: GenerationEngine, body: dict, default: bool = False, message: str = "aborted for a weight update"
) -> None:
    if field(body, "abort_all_requests", "boolean", default):
        engine.abort(abort_all=True, message=message)


@router.get("/get_weight_version")
async def get_weight_version(request: Request):
    return {"weight_version": engine_of(request).weight_version}


@router.post("/update_weight_version")
async def update_weight_version(request: Request):
    engine, body = engine_of(request), await read_body(request)
    version = field(body, "new_version", "version", required=True)
    _abort_requests_if_asked(engine, body, default=True, message="aborted by /update_weight_version")
    engine.weight_version = version
    return control(True, f"weight_version={engine.weight_version}", new_version=engine.weight_version)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request):
    engine, body = engine_of(request), await read_body(request)
    if problem := _selector_problem(body):
        return control(False, problem)
    payloads = body.get("serialized_named_tensors")
    payloads = [payloads] if isinstance(payloads, str) else payloads
    if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
        return control(
            False,
            "serialized_named_tensors must be a non-empty list of base64 strings "
            "(one per TP rank: rank r reads entry r; a single entry is read by every rank)",
        )
    args = (
        field(body, "load_format", "string"),
        field(body, "weight_version", "version"),
        field(body, "defer", "boolean", False),
    )
    _abort_requests_if_asked(engine, body)
    # every rank decodes its entry through the allow-list unpickler (weights_codec)
    return await _run("update_weights_from_tensor", engine.update_weights_from_payloads, payloads, *args)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request):
    server, body = server_of(request), await read_body(request)
    if not isinstance(body.get("model_path"), str) or not body["model_path"]:
        return control(False, "model_path (a directory with *.safetensors) is required", num_paused_requests=0)
    version = field(body, "weight_version", "version")
    try:
        path = confine(body["model_path"], server.weight_dirs)
    except PathNotAllowed as exc:
        return JSONResponse({"success": False, "message": str(exc), "num_paused_requests": 0}, status_code=403)
    except ValueError as exc:  # a NUL byte in the path
        return control(False, f"model_path is not a usable path: {exc}", num_paused_requests=0)
    _abort_requests_if_asked(server.engine, body)
    return await _run(
        "update_weights_from_disk", server.engine.update_weights_from_disk, path, version, num_paused_requests=0
    )


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request):
    body = await read_body(request)
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if body.get(k) is None]
    if missing:
        return control(
            False,
            f"init_weights_update_group needs {missing} (SGLang's fields: master_address, "
            "master_port, rank_offset, world_size, group_name, backend)",
        )
    args = (
        field(body, "master_address", "string"),
        field(body, "master_port", "integer", low=1, high=65535),
        field(body, "rank_offset", "integer", low=0),
        field(body, "world_size", "integer", low=1),
        field(body, "group_name", "string") or _DEFAULT_GROUP,
        field(body, "backend", "string"),
    )
    if args[-1] not in (None, "gloo", "nccl"):
        return control(False, f"backend={args[-1]!r} must be 'gloo' (CPU) or 'nccl' (CUDA)")
    engine = engine_of(request)
    if args[-1] == "nccl" and engine.device.type != "cuda":
        # refused before joining: the sender would otherwise wait in the rendezvous until it times out
        return control(False, "backend='nccl' needs CUDA and this engine runs on CPU; send backend='gloo'")
    return await _run("init_weights_update_group", engine.init_weights_update_group, *args)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request):
    body = await read_body(request)
    return await _run(
        "destroy_weights_update_group",
        engine_of(request).destroy_weights_update_group,
        field(body, "group_name", "string") or _DEFAULT_GROUP,
    )


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request):
    engine, body = engine_of(request), await read_body(request)
    group = field(body, "group_name", "string") or _DEFAULT_GROUP
    version, defer = field(body, "weight_version", "version"), field(body, "defer", "boolean", False)
    _abort_requests_if_asked(engine, body)
    # flush_cache: nothing to flush, the embedded engine keeps no KV cache between batches.
    # Malformed names/dtypes/shapes are refused by the ranks, which then close the group: its
    # sender is waiting in a broadcast that would otherwise never be matched.
    fields = {
        "group_name": group,
        "names": body.get("names"),
        "dtypes": body.get("dtypes"),
        "shapes": body.get("shapes"),
        "load_format": body.get("load_format"),
    }
    return await _run(
        f"update_weights_from_distributed over group {group!r}",
        engine.update_weights_from_distributed,
        fields,
        version,
        defer,
    )


@router.post("/update_weights_from_reshard")
async def update_weights_from_reshard(request: Request):
    engine, body = engine_of(request), await read_body(request)
    group = body.get("group_name")
    if not isinstance(group, str):
        return control(False, "group_name (the reshard group, created with /init_weights_update_group) is required")
    version, defer = field(body, "weight_version", "version"), field(body, "defer", "boolean", True)
    _abort_requests_if_asked(engine, body)
    return await _run(
        f"update_weights_from_reshard over group {group!r}",
        engine.update_weights_from_reshard,
        group,
        body.get("ranks"),
        version,
        defer,
    )


@router.post("/commit_weight_update")
async def commit_weight_update(request: Request):
    body = await read_body(request)
    if body.get("weight_version") is None:
        return control(False, "weight_version (the version the staged update was built for) is required")
    try:
        message, count = await run_in_threadpool(
            engine_of(request).commit_weight_update, field(body, "weight_version", "version")
        )
    except _FAILURES as exc:
        return control(False, f"commit_weight_update failed: {exc}")
    return control(True, message, num_tensors=count)


@router.post("/abort_weight_update")
async def abort_weight_update(request: Request):
    await read_body(request)  # none expected; a malformed one is refused like everywhere else
    return await _run("abort_weight_update", engine_of(request).abort_weight_update)
