"""Engine results -> SGLang's /generate answer items ({"text", "output_ids", "meta_info"}).

Log-prob fields use SGLang's shapes: `*_token_logprobs` are [logprob, token_id, text] triples;
`*_top_logprobs` and `*_token_ids_logprobs` hold one list of such triples per position (None for
the first prompt token, which nothing predicts); text is the token's decoding only with
return_text_in_logprobs, else null. Non-finite floats (a token masked to -inf by min_new_tokens
or logit_bias) become null, as SGLang's orjson writes them. A prompt with images (a
vision-language engine, image_data.py) is reported as the engine ran it, each image's one pad
expanded to prod(grid) / merge^2 pads as in SGLang: prompt_tokens, prompt_token_ids and the input
log-probs (logprob_start_len counts from its start) are those of the expanded prompt.

meta_info carries SGLang's fields (id, finish_reason, prompt_tokens, completion_tokens,
cached_tokens, weight_version: the engine's version when the answer was made, num_retractions,
e2e_latency) and `weight_versions`, SGLang's spans `[{"version", "start", "end"}, ...]` of the
output tokens each weight version produced (megarl/wire/weight_versions.py; a request that ran
across a weight update, an in-place pause or a retraction has several; they cover
completion_tokens; megarl/rollout/client/partial.py merges them across resumed requests).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable

import numpy as np

from megarl.rollout.engine.protocol import GenerationRequest, GenerationResult
from megarl.rollout.server.generate_input import GenerateCall
from megarl.wire import routing
from megarl.wire.weight_versions import spans_from_runs

TokenText = Callable[[int], str]


def output_item(result: GenerationResult, req: GenerationRequest, call: GenerateCall, token_text: TokenText) -> dict:
    """One answer item; a result with finish_reason None is a streamed snapshot (no e2e_latency)."""
    meta = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "weight_version": result.weight_version,
        "num_retractions": result.num_retractions,
    }
    if result.weight_versions is not None:
        meta["weight_versions"] = spans_from_runs(result.weight_versions, result.weight_version)
    if result.finish_reason is not None:
        meta["e2e_latency"] = result.e2e_latency
    text_of = token_text if call.token_text else None
    if req.return_logprob:
        meta.update(_logprob_fields(result, req, call, text_of))
    if result.output_entropy is not None:
        meta["output_token_entropy"] = [_finite(e) for e in result.output_entropy]
    if result.routed_experts is not None:
        meta["routed_experts"] = routing.encode(result.routed_experts, req.routed_experts_start_len)
    item = {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}
    if call.prompt_token_ids:
        item["prompt_token_ids"] = result.input_ids
    return item


def _logprob_fields(result: GenerationResult, req: GenerationRequest, call: GenerateCall, text_of) -> dict:
    fields = {}
    if result.output_logprobs is not None:
        fields["output_token_logprobs"] = _triples(zip(result.output_logprobs, result.output_ids), text_of)
    if result.input_logprobs is not None:
        prompt = result.input_ids[len(result.input_ids) - len(result.input_logprobs) :]
        fields["input_token_logprobs"] = _triples(zip(result.input_logprobs, prompt), text_of)
    if req.top_logprobs_num:
        if result.output_top_logprobs is not None:
            fields["output_top_logprobs"] = _positions(result.output_top_logprobs, text_of)
        if result.input_top_logprobs is not None:
            if call.flat_top_logprobs:
                fields.update(flat_top_logprobs(result.input_top_logprobs, req.top_logprobs_num, call.flat_b64))
            else:
                fields["input_top_logprobs"] = _positions(result.input_top_logprobs, text_of)
    if req.token_ids_logprob:
        if result.output_token_ids_logprobs is not None:
            fields["output_token_ids_logprobs"] = _positions(result.output_token_ids_logprobs, text_of)
        if result.input_token_ids_logprobs is not None:
            fields["input_token_ids_logprobs"] = _positions(result.input_token_ids_logprobs, text_of)
    return fields


def _finite(x):
    return x if x is None or math.isfinite(x) else None


def _triples(pairs, text_of) -> list[list]:
    return [[_finite(lp), t, text_of(t) if text_of else None] for lp, t in pairs]


def _positions(per_position, text_of) -> list:
    return [None if pairs is None else _triples(pairs, text_of) for pairs in per_position]


def flat_top_logprobs(per_position: list, k: int, b64: bool) -> dict:
    """SGLang's return_flat_raw_top_logprobs form of input_top_logprobs: the leading positions
    without a distribution (`null_prefix`) dropped, the rest as flat [rows * k] arrays of
    values and token ids; with b64, little-endian float32 / int32 bytes in base64."""
    null_prefix = next((i for i, pairs in enumerate(per_position) if pairs is not None), len(per_position))
    rows = per_position[null_prefix:]
    width = len(rows[0]) if rows else k
    values = [lp for pairs in rows for lp, _ in pairs]
    ids = [t for pairs in rows for _, t in pairs]
    fields = {"input_top_logprobs_shape": [len(rows), width], "input_top_logprobs_null_prefix": null_prefix}
    if not b64:
        return {
            "input_top_logprobs_val_flat": [_finite(v) for v in values],
            "input_top_logprobs_idx_flat": ids,
            **fields,
        }
    encode = lambda array: base64.b64encode(array.tobytes()).decode("ascii")  # noqa: E731
    return {
        "input_top_logprobs_val_flat_b64": encode(np.asarray(values, dtype="<f4")),
        "input_top_logprobs_idx_flat_b64": encode(np.asarray(ids, dtype="<i4")),
        "input_top_logprobs_val_flat_b64_dtype": "float32",
        "input_top_logprobs_idx_flat_b64_dtype": "int32",
        **fields,
    }
