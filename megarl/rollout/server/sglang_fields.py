"""Every field of SGLang's /generate body (GenerateReqInput) and of its sampling_params
(SamplingParams), and what the embedded server does with each.

Pinned to SGLang 0.5.23: the tables hold exactly the fields of its GenerateReqInput
(srt/managers/io_struct.py) and SamplingParams (srt/sampling/sampling_params.py) plus those of
its HTTP JSON contract (sglang.api.v1's SamplingParams adds `choice`), at its defaults; a field
that only another release has is kept only if NOT_IN_PINNED names it and who sends it. The
contract tests (`pytest tests -k sglang_contract`, with sglang installed by
scripts/install_sglang.sh) compare the tables with the installed release and post every field,
at its default and at another value, to this server; a field added, removed or re-defaulted
upstream fails a test that names it. For a newer release: bump the pin in
scripts/install_sglang.sh, run it and the tests, and update these tables. Each field is one of:

- HONOURED: the engine does what SGLang does with it.
- NO_OP: accepted with any value; it changes nothing here (metrics, routing hints, priorities,
  disaggregation bootstrap, options that only act on inputs this server refuses).
- OFF_ONLY: accepted only at a value that means "off" (its default, null, false, [], {}, or a
  list of those); anything else asks for something this engine cannot give and gets HTTP 400
  with the reason. Those marked `vision` (image_data, modalities) are HONOURED when the engine
  serves a vision-language model (Qwen2.5-VL: image_data.py) and OFF_ONLY with a text model,
  which has no vision tower to take them.

A field in neither table is not SGLang's and gets HTTP 400 too (with a spelling hint), because a
misspelt option silently ignored is worse than a rejected request.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from megarl.rollout.engine.protocol import InvalidRequest

HONOURED, NO_OP, OFF_ONLY = "honoured", "no-op", "off only"
TOP_K_ALL = 1 << 30  # SGLang's default top_k ("whole vocabulary"); -1 means the same


@dataclass(frozen=True)
class Field:
    kind: str
    default: object = None  # SGLang's default
    why: str = ""  # OFF_ONLY: why another value is refused; NO_OP: why it changes nothing here
    vision: bool = False  # OFF_ONLY on a text model, HONOURED by a vision-language model


def _off(why: str, default=None) -> Field:
    return Field(OFF_ONLY, default, why)


def _noop(why: str, default=None) -> Field:
    return Field(NO_OP, default, why)


_TEXT_ONLY = "the embedded engine takes text and images only"
_NO_VISION = (
    "this model has no vision tower; images go to a vision-language model (Qwen2.5-VL), which takes them as SGLang does"
)
_NO_MM = "it only shapes video or audio inputs, which this server refuses"
_TILING = "only dynamic-tiling processors (InternVL-style) read it; Qwen2.5-VL's resizes each image whole"
_EPD = "encoder disaggregation; this server runs the vision tower itself"
_ROUTING = "a routing or scheduling hint; this server is one engine with one queue"
_PD = "prefill/decode disaggregation; this server runs both phases itself"
_OBSERVABILITY = "metrics and request logging; this server keeps neither per request"

GENERATE_FIELDS: dict[str, Field] = {
    # the prompt
    "text": Field(HONOURED),
    "input_ids": Field(HONOURED),
    "rid": Field(HONOURED),
    "input_embeds": _off("prompt embeddings are not accepted; send text or input_ids"),
    "sampling_params": Field(HONOURED),
    # what comes back
    "return_logprob": Field(HONOURED),
    "logprob_start_len": Field(HONOURED),
    "top_logprobs_num": Field(HONOURED),
    "token_ids_logprob": Field(HONOURED),
    "return_text_in_logprobs": Field(HONOURED, False),
    "stream": Field(HONOURED, False),
    "return_flat_raw_top_logprobs": Field(HONOURED, False),
    "return_flat_raw_top_logprobs_b64": Field(HONOURED, False),
    "return_entropy": Field(HONOURED, False),
    "return_prompt_token_ids": Field(HONOURED, False),
    "return_sampling_mask": _off("per-token sampling-support masks are not produced by this engine"),
    "sampling_logprobs_mode": _off("behaviour log-probs over the sampling support are not produced by this engine"),
    "return_flat_raw_output_top_logprobs": _off(
        "flat output top log-probs are not produced; ask for top_logprobs_num's nested lists", False
    ),
    "return_hidden_states": _off("hidden states are not returned by this engine", False),
    # MoE routing records, SGLang's wire format (megarl/wire/routing.py says it): base64 int32
    # [prompt + output - 1 - routed_experts_start_len, num_hidden_layers, top_k] in meta_info
    "return_routed_experts": Field(HONOURED, False),
    "routed_experts_start_len": Field(HONOURED, 0),
    "return_indexer_topk": _off("sparse-attention indexer records are not kept by this engine", False),
    "return_bytes": _noop("only image generation returns bytes", False),
    # images: a vision-language model's (image_data.py: base64, data: URLs, file paths; one pad
    # per image in the prompt), refused by a text model; other modalities: refused
    "image_data": Field(OFF_ONLY, None, _NO_VISION, vision=True),
    "modalities": Field(OFF_ONLY, None, _NO_VISION, vision=True),  # a VLM takes "image" / "multi-images"
    "video_data": _off(_TEXT_ONLY),
    "audio_data": _off(_TEXT_ONLY),
    "mm_hashes": _off("images are sent whole; this engine keeps no cache of image features by hash"),
    "mm_content_hashes": _off("images are sent whole; this engine keeps no cache of image features by hash"),
    "use_audio_in_video": _noop(_NO_MM, False),
    "video_config": _noop(_NO_MM),
    "images_config": _noop("only the Unlimited-OCR processor reads it"),
    "mm_processor_kwargs": _off(
        "per-request image-processor options are not applied: images are processed with the "
        "checkpoint's preprocessor_config.json"
    ),
    "max_dynamic_patch": _noop(_TILING),
    "min_dynamic_patch": _noop(_TILING),
    "image_max_dynamic_patch": _noop(_TILING),
    "video_max_dynamic_patch": _noop(_NO_MM),
    "need_wait_for_mm_inputs": _noop(_EPD),
    "num_items_assigned": _noop(_EPD),
    "encoder_urls": _noop(_EPD),
    "positional_embed_overrides": _off("embedding overrides are not accepted; send token ids"),
    "token_indices_to_pool": _off("pooling is for embedding requests, which this server does not serve"),
    "watermark": _off("watermarking is not implemented by this engine"),
    "multi_item_delimiter_indices": _off("multi-item scoring is not implemented by this engine"),
    "session_params": _off("continual-prompting sessions are not kept by this engine"),
    "lora_path": Field(HONOURED),  # the loaded adapter's name (engine/lora.py) or null
    "lora_id": _off("adapters are named by lora_path here (SGLang's TokenizerManager fills lora_id in)"),
    "custom_logit_processor": _off("custom logit processors would run client code in the server"),
    "require_reasoning": _off("only hybrid reasoning models honour it", False),
    "max_thinking_tokens": _off("thinking budgets need a reasoning parser this engine does not have"),
    # hints and bookkeeping that change nothing here
    "log_metrics": _noop(_OBSERVABILITY, True),
    "no_logs": _noop(_OBSERVABILITY, False),
    "custom_labels": _noop(_OBSERVABILITY),
    "external_trace_header": _noop(_OBSERVABILITY),
    "received_time": _noop(_OBSERVABILITY),
    "conversation_id": _noop(_OBSERVABILITY),
    "priority": _noop(_ROUTING),
    "routing_key": _noop(_ROUTING),
    "routed_dp_rank": _noop(_ROUTING),
    "data_parallel_rank": _noop(_ROUTING),
    "dp_balance_id": _noop(_ROUTING),
    "disagg_prefill_dp_rank": _noop(_PD),
    "kv_router_hint": _noop(_ROUTING),
    "http_worker_ipc": _noop(_ROUTING),
    "session_id": _noop("a session label that does not change the prompt"),
    "bootstrap_host": _noop(_PD),
    "bootstrap_port": _noop(_PD),
    "bootstrap_room": _noop(_PD),
    "bootstrap_pair_key": _noop(_PD),
    "decode_tp_size": _noop(_PD),
    "extra_key": _noop("a prefix-cache key; this engine keeps no cache between batches"),
    "kv_hints": _noop("KV-cache transfer hints; this engine keeps no cache between batches"),
    "cache_salt": _noop("a prefix-cache namespace; this engine keeps no cache between batches"),
    "background": _noop("the OpenAI responses API's flag; /generate answers in the foreground", False),
    "model": _noop("sglang-router adds it; this server serves exactly one model"),
}

# Fields of GENERATE_FIELDS that the pinned release's GenerateReqInput does not have, and who sends
# them; the contract tests accept a field missing upstream only if it is named here.
NOT_IN_PINNED: dict[str, str] = {
    "model": "sglang-router 0.3.2 adds it to every /generate body it forwards",
    "dp_balance_id": "older 0.5 releases (before 0.5.23)",
    "kv_router_hint": "older 0.5 releases (before 0.5.23)",
}

_GRAMMAR = "constrained decoding (grammars, JSON schemas, regexes) is not implemented by this engine"
_INTERNAL = "set by SGLang's tokenizer manager from 'stop' / 'stop_regex', recomputed here the same way"

SAMPLING_FIELDS: dict[str, Field] = {
    **{
        name: Field(HONOURED, default)
        for name, default in [
            ("max_new_tokens", 128),
            ("stop", None),
            ("stop_token_ids", None),
            ("stop_regex", None),
            ("temperature", 1.0),
            ("top_p", 1.0),
            ("top_k", TOP_K_ALL),
            ("min_p", 0.0),
            ("frequency_penalty", 0.0),
            ("presence_penalty", 0.0),
            ("repetition_penalty", 1.0),
            ("min_new_tokens", 0),
            ("n", 1),
            ("ignore_eos", False),
            ("skip_special_tokens", True),
            ("spaces_between_special_tokens", True),
            ("no_stop_trim", False),
            ("logit_bias", None),
            ("sampling_seed", None),
            ("stream_interval", None),
        ]
    },
    "json_schema": _off(_GRAMMAR),
    "regex": _off(_GRAMMAR),
    "ebnf": _off(_GRAMMAR),
    "structural_tag": _off(_GRAMMAR),
    "beam_width": _off("beam search is not implemented by this engine"),
    "watermark": _off("watermarking is not implemented by this engine"),
    "ebnf_full_assistant": _off(_GRAMMAR, False),
    "choice": _off(_GRAMMAR, []),  # only in the HTTP JSON contract (sglang.api.v1), not the dataclass
    "custom_params": _noop("only custom logit processors read it, and those are refused"),
    "stop_strs": _noop(_INTERNAL),
    "stop_regex_strs": _noop(_INTERNAL),
    "stop_str_max_len": _noop(_INTERNAL, 0),
    "stop_regex_max_len": _noop(_INTERNAL, 0),
    "is_normalized": _off("SGLang's internal 'already normalised' marker", False),
}


def is_off(value, default=None) -> bool:
    """Whether a value means "not asked for": null, false, empty, the default, or a list of those."""
    if value is None or value is False or value in ([], {}, ""):
        return True
    if value is not True and value == default:  # True == 1 in Python; a flag set is never "off"
        return True
    return isinstance(value, list) and all(is_off(v, default) for v in value)


def check_fields(raw: dict, table: dict[str, Field], where: str, vision: bool = False) -> None:
    """Refuse (InvalidRequest, naming the field, the value and why) unknown fields and OFF_ONLY
    fields set to something else; HONOURED fields are validated by their parsers. `vision`: the
    engine serves a vision-language model, whose `vision` fields are honoured."""
    for key, value in raw.items():
        rule = table.get(key)
        if rule is None:
            hint = difflib.get_close_matches(key, table, n=1)
            raise InvalidRequest(
                f"{where}{key!r} is not a field of SGLang's {_kind(table)}"
                + (f"; did you mean {hint[0]!r}?" if hint else "")
                + " (megarl/rollout/server/sglang_fields.py lists every accepted field)"
            )
        if rule.kind == OFF_ONLY and not (vision and rule.vision) and not is_off(value, rule.default):
            raise InvalidRequest(
                f"{where}{key}={value!r:.120} is not supported by the embedded rollout server: "
                f"{rule.why}; leave it out or set it to {rule.default!r}"
            )


def _kind(table: dict[str, Field]) -> str:
    return "/generate body (GenerateReqInput)" if table is GENERATE_FIELDS else "sampling_params (SamplingParams)"


def defaults(table: dict[str, Field]) -> dict:
    """Every field at SGLang's default: what a client that fills in the whole struct sends."""
    return {name: rule.default for name, rule in table.items()}
