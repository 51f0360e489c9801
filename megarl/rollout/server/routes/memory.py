"""/release_memory_occupation and /resume_memory_occupation: SGLang's memory-saver calls.

`tags` picks what to release or resume, a subset of weights, kv_cache and cuda_graph (none or an
empty list: all). Only the weights are held between requests here: the KV cache lives inside a
running batch and no CUDA graph is captured, so those tags are answered with why nothing changed.
While the weights are released /generate answers 503.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from megarl.rollout.server.http_common import control, read_body
from megarl.rollout.server.state import engine_of

router = APIRouter()
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request):
    return await _memory_occupation(request, release=True)


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request):
    return await _memory_occupation(request, release=False)


async def _memory_occupation(request: Request, release: bool) -> JSONResponse:
    tags = (await read_body(request)).get("tags")
    tags = list(MEMORY_TAGS) if tags is None or tags == [] else tags  # a falsy 0 or {} is not "all"
    tags = [tags] if isinstance(tags, str) else tags
    if not isinstance(tags, list):
        return control(False, f"tags must be a list of strings, a subset of {list(MEMORY_TAGS)}")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        return control(False, f"tags {unknown} unknown; use a subset of {list(MEMORY_TAGS)}")
    engine, messages = engine_of(request), []
    if "weights" in tags:
        action = engine.release_weights if release else engine.resume_weights
        messages.append("weights: " + await run_in_threadpool(action))
    if "kv_cache" in tags:
        messages.append("kv_cache: nothing held; the KV cache exists only inside a running batch")
    if "cuda_graph" in tags:
        messages.append("cuda_graph: not used by the embedded engine")
    return control(True, "; ".join(messages))
