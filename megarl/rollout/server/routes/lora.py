"""The embedded server's LoRA endpoints, SGLang's: /load_lora_adapter_from_tensors (a PEFT
adapter's tensors, one weights_codec payload per TP rank, and its adapter_config.json),
/load_lora_adapter (a PEFT folder under the server's allowed weight directories) and
/unload_lora_adapter. The engine merges the adapter into its weights (engine/lora.py). Answers are
SGLang's {"success", "message"}; a refused one is a 400 naming what was wrong."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from megarl.rollout.server.http_common import control, field, read_body
from megarl.rollout.server.routes.weights import _run
from megarl.rollout.server.state import engine_of, server_of
from megarl.rollout.server.weight_dirs import PathNotAllowed, confine

router = APIRouter()


def _name(body: dict) -> str | None:
    name = body.get("lora_name")
    return name if isinstance(name, str) and name else None


def _merge_payload(engine, name: str, config: dict, payloads: list, load_format):
    """Decode the payload meant for every rank (the adapter is merged whole; the update that
    writes it slices per rank) and merge it."""
    from megarl.wire.weights_codec import decode_payload

    tensors = dict(decode_payload(payloads[0], load_format))
    return engine.load_lora_adapter_from_tensors(name, config, tensors)


@router.post("/load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(request: Request):
    engine, body = engine_of(request), await read_body(request)
    name, config = _name(body), body.get("config_dict")
    payloads = body.get("serialized_named_tensors")
    payloads = [payloads] if isinstance(payloads, str) else payloads
    if name is None or not isinstance(config, dict):
        return control(False, "lora_name (a non-empty string) and config_dict (adapter_config.json) are required")
    if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
        return control(False, "serialized_named_tensors must be a non-empty list of base64 strings")
    if body.get("added_tokens_config"):
        return control(False, "added_tokens_config: adapters with added tokens are not merged by this engine")
    load_format = field(body, "load_format", "string")
    return await _run(f"loading LoRA adapter {name!r}", _merge_payload, engine, name, config, payloads, load_format)


def _read_folder(engine, name: str, path: str):
    from safetensors.torch import load_file

    folder = Path(path)
    config = json.loads((folder / "adapter_config.json").read_text())
    return engine.load_lora_adapter_from_tensors(name, config, load_file(str(folder / "adapter_model.safetensors")))


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request):
    server, body = server_of(request), await read_body(request)
    name, path = _name(body), body.get("lora_path")
    if name is None or not isinstance(path, str) or not path:
        return control(False, "lora_name and lora_path (a PEFT adapter folder) are required")
    try:
        path = confine(path, server.weight_dirs, key="lora_path")
    except PathNotAllowed as exc:
        return JSONResponse({"success": False, "message": str(exc)}, status_code=403)
    except ValueError as exc:
        return control(False, f"lora_path is not a usable path: {exc}")
    return await _run(f"loading LoRA adapter {name!r} from {path}", _read_folder, server.engine, name, path)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    engine, body = engine_of(request), await read_body(request)
    name = _name(body)
    if name is None:
        return control(False, "lora_name is required")
    return await _run(f"unloading LoRA adapter {name!r}", engine.unload_lora_adapter, name)
