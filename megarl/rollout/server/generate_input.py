"""SGLang's /generate body (GenerateReqInput) -> engine requests, with SGLang's rules.

Every field is checked against sglang_fields.py first (unknown or unsupported -> InvalidRequest
naming it); the honoured ones are parsed here with SGLang's ranges. Batched input with n > 1
expands prompt-major ([p0s0, p0s1, ..., p1s0, ...]), as SGLang's TokenizerManager does; a single
prompt with n > 1 becomes a batch of one. A vision-language engine also takes `image_data`
(image_data.py): each prompt's pads are expanded before anything else is checked, so lengths
(context, max_new_tokens=null, input log-probs, prompt_tokens) count the expanded prompt, as in
SGLang; the n samples of a prompt share its images.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

from megarl.rollout.engine.protocol import GenerationRequest, InvalidRequest, SamplingParams
from megarl.rollout.server.image_data import attach, check_modalities
from megarl.rollout.server.sglang_fields import GENERATE_FIELDS, SAMPLING_FIELDS, check_fields

_GREEDY_BELOW = 1e-6  # temperatures this small are greedy, as in SGLang
# Samples (prompts x n) one /generate may ask for: each becomes a request object before any runs, so
# an unbounded n would exhaust memory. Far above an RL step's batch on one engine (512 prompts x 16);
# RolloutClient(max_batch_prompts=...) splits larger batches into several calls.
MAX_SAMPLES_PER_CALL = 2**17


@dataclass
class GenerateCall:
    """One /generate call: its engine requests (prompt-major) and how to shape the answer."""

    requests: list[GenerationRequest]
    single: bool  # answer one object rather than a list
    stream: bool
    token_text: bool  # return_text_in_logprobs
    flat_top_logprobs: bool  # return_flat_raw_top_logprobs
    flat_b64: bool  # return_flat_raw_top_logprobs_b64
    prompt_token_ids: bool  # return_prompt_token_ids


# ---- scalars ---------------------------------------------------------------------------------------
def _integer(value, where: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not (isinstance(value, int) or isinstance(value, float) and value.is_integer()):
        raise InvalidRequest(f"{where}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise InvalidRequest(f"{where}={value!r} must be >= {minimum}")
    return int(value)


def _number(value, where: str, low: float | None = None, high: float | None = None, rule: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"{where}={value!r} must be a finite number")
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidRequest(f"{where}={value!r} must be {rule or f'in [{low}, {high}]'}")
    return float(value)


def _positive(value, where: str, high: float, rule: str) -> float:
    """A number in (0, high]: SGLang's rule for top_p and repetition_penalty."""
    number = _number(value, where, 0, high, rule)
    if number == 0:
        raise InvalidRequest(f"{where}={value!r} must be {rule}")
    return number


def _flag(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{where}={value!r} must be true or false")
    return value


def _strings(value, where: str) -> tuple[str, ...]:
    value = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise InvalidRequest(f"{where}={value!r} must be a non-empty string or a list of them")
    return tuple(value)


# ---- sampling_params -----------------------------------------------------------------------------
def parse_sampling_params(
    raw: dict | None, where: str = "sampling_params", room: int | None = None
) -> tuple[SamplingParams, int]:
    """SGLang sampling_params dict -> (SamplingParams, n). `room`: tokens left in the context
    after the prompt, which an explicit "max_new_tokens": null asks for (SGLang's "no limit")."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} must be an object, got {type(raw).__name__}")
    check_fields(raw, SAMPLING_FIELDS, f"{where}.")
    get = lambda key, default: default if raw.get(key) is None else raw[key]  # noqa: E731
    max_new = _integer(get("max_new_tokens", 128), f"{where}.max_new_tokens", minimum=0)
    if "max_new_tokens" in raw and raw["max_new_tokens"] is None and room is not None:
        max_new = room
    temperature = _number(get("temperature", 1.0), f"{where}.temperature", 0, None, ">= 0 (0 is greedy)")
    min_new = _integer(get("min_new_tokens", 0), f"{where}.min_new_tokens", minimum=0)
    if min_new > max_new:
        raise InvalidRequest(f"{where}.min_new_tokens={min_new} must be <= max_new_tokens={max_new}")
    seed, interval = raw.get("sampling_seed"), raw.get("stream_interval")
    params = SamplingParams(
        max_new_tokens=max_new,
        temperature=0.0 if temperature < _GREEDY_BELOW else temperature,
        top_p=_positive(get("top_p", 1.0), f"{where}.top_p", 1, "in (0, 1]"),
        top_k=_integer(get("top_k", -1), f"{where}.top_k", minimum=-1),
        min_p=_number(get("min_p", 0.0), f"{where}.min_p", 0, 1),
        frequency_penalty=_number(get("frequency_penalty", 0.0), f"{where}.frequency_penalty", -2, 2),
        presence_penalty=_number(get("presence_penalty", 0.0), f"{where}.presence_penalty", -2, 2),
        repetition_penalty=_positive(
            get("repetition_penalty", 1.0), f"{where}.repetition_penalty", 2, "in (0, 2] (1 = no penalty)"
        ),
        min_new_tokens=min_new,
        logit_bias=_logit_bias(raw.get("logit_bias"), f"{where}.logit_bias"),
        stop=_strings(raw.get("stop"), f"{where}.stop"),
        stop_regex=tuple(
            _compile(s, f"{where}.stop_regex") for s in _strings(raw.get("stop_regex"), f"{where}.stop_regex")
        ),
        stop_token_ids=_token_ids(raw.get("stop_token_ids"), f"{where}.stop_token_ids"),
        ignore_eos=_flag(get("ignore_eos", False), f"{where}.ignore_eos"),
        skip_special_tokens=_flag(get("skip_special_tokens", True), f"{where}.skip_special_tokens"),
        spaces_between_special_tokens=_flag(
            get("spaces_between_special_tokens", True), f"{where}.spaces_between_special_tokens"
        ),
        no_stop_trim=_flag(get("no_stop_trim", False), f"{where}.no_stop_trim"),
        sampling_seed=None if seed is None else _integer(seed, f"{where}.sampling_seed"),
        stream_interval=1 if interval is None else _integer(interval, f"{where}.stream_interval", minimum=1),
    )
    return params, _integer(get("n", 1), f"{where}.n", minimum=1)


def _parse_each_sampling_params(raw_params, prompts: list[list[int]], context: int | None) -> list[tuple]:
    """parse_sampling_params of each prompt's sampling_params. A batched call's rows usually
    differ only in sampling_seed (RolloutManager's seeded rows: 256 dicts a quickstart step, 4 ms
    to parse one by one); a dict of plain values equal to an earlier one but for its seed reuses
    that one's parse, with only the seed checked. Values are compared with their types (True is
    not 1), so a reused parse is one that passed the same checks."""
    listed = isinstance(raw_params, list)
    parsed, seen = [], {}
    for i, raw in enumerate(_per_prompt(raw_params, len(prompts), "sampling_params", None)):
        where = f"sampling_params[{i}]" if listed else "sampling_params"
        room = None if context is None else max(context - len(prompts[i]), 0)
        key = _plain_key(raw, room)
        if key is not None and key in seen:
            params, n = seen[key]
            seed = raw.get("sampling_seed")
            parsed.append((_with_seed(params, None if seed is None else _integer(seed, f"{where}.sampling_seed")), n))
            continue
        parsed.append(parse_sampling_params(raw, where, room=room))
        if key is not None:
            seen[key] = parsed[-1]
    return parsed


def _with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    """`params` with another sampling_seed: dataclasses.replace re-runs __init__ through every
    field (12 us); a frozen dataclass without __post_init__ can be copied by its __dict__ (1 us)."""
    clone = object.__new__(SamplingParams)
    clone.__dict__.update(params.__dict__, sampling_seed=seed)
    return clone


def _plain_key(raw, room: int | None) -> tuple | None:
    """A hashable key of a sampling_params dict without its sampling_seed, or None when a value
    is not a plain scalar (lists, objects: always parsed)."""
    if not isinstance(raw, dict):
        return None
    items = []
    for key, value in raw.items():
        if key == "sampling_seed":
            continue
        if value is not None and not isinstance(value, (str, int, float)):
            return None
        items.append((key, type(value), value))
    return (room, *sorted(items, key=lambda item: item[0]))


def _logit_bias(raw, where: str) -> tuple[tuple[int, float], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where}={raw!r:.80} must be an object mapping token ids to biases")
    try:
        ids = [int(key) for key in raw]
    except ValueError as exc:
        raise InvalidRequest(f"{where} has a key that is not a token id: {exc}") from None
    return tuple((t, _bias(b, f"{where}[{t}]")) for t, b in zip(ids, raw.values()))


def _bias(value, where: str) -> float:
    if value == float("-inf"):  # bans the token (a JSON body can carry it as -Infinity)
        return value
    return _number(value, where)


def _token_ids(raw, where: str) -> frozenset[int]:
    raw = [] if raw is None else raw
    if not isinstance(raw, list):
        raise InvalidRequest(f"{where}={raw!r} must be a list of token ids")
    return frozenset(_integer(t, f"{where}[]", minimum=0) for t in raw if t is not None)


def _compile(pattern: str, where: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise InvalidRequest(f"{where}={pattern!r} is not a valid regular expression: {exc}") from None


# ---- the body ------------------------------------------------------------------------------------
def _per_prompt(value, count: int, name: str, default) -> list:
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise InvalidRequest(f"{name} has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


def _prompts(body: dict, engine) -> tuple[list[list[int]], bool]:
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


def _prompts_and_images(body: dict, engine) -> tuple[list[list[int]], bool, list]:
    """(token ids per prompt, single, each prompt's images or None). A vision-language engine
    takes image_data (image_data.py); its prompts come back with each image's pad expanded."""
    vision = getattr(engine, "vision", None) is not None
    check_fields(body, GENERATE_FIELDS, "", vision=vision)
    prompts, single = _prompts(body, engine)
    if not vision:
        return prompts, single, [None] * len(prompts)
    if body.get("modalities") is not None:
        check_modalities(body["modalities"])
    field = "text" if body.get("text") is not None else "input_ids"
    fields = [field] if single else [f"{field}[{i}]" for i in range(len(prompts))]
    prompts = list(prompts)  # the expanded prompts replace the body's
    return prompts, single, attach(engine, prompts, body.get("image_data"), single, fields)


def _token_ids_logprob(raw, count: int) -> list[tuple[int, ...] | None]:
    """SGLang's shapes: null or [] (none), list[int] (the same ids for every prompt), list[list[int]]."""
    if not raw:
        return [None] * count
    raw = raw if isinstance(raw, list) else [raw]
    rows = raw if all(isinstance(r, list) for r in raw) else [raw] * count
    if len(rows) != count:
        raise InvalidRequest(f"token_ids_logprob has {len(rows)} lists for {count} prompts")
    return [tuple(_integer(t, "token_ids_logprob[]", minimum=0) for t in r) or None for r in rows]


def _rids(raw, count: int, single: bool) -> list[str]:
    if isinstance(raw, str) and not single:
        return [f"{raw}_{i}" for i in range(count)]  # SGLang's expansion of one rid over a batch
    rids = _per_prompt(raw, count, "rid", None)
    bad = [r for r in rids if r is not None and not isinstance(r, str)]
    if bad:
        raise InvalidRequest(f"rid={str(bad[0])[:80]} must be a string (or a list of strings, one per prompt)")
    rids = [r if r is not None else uuid.uuid4().hex for r in rids]
    if len(set(rids)) != len(rids):
        raise InvalidRequest(
            f"rid has duplicates {sorted({r for r in rids if rids.count(r) > 1})}; each prompt needs its own request id"
        )
    return rids


def parse_generate(body: Any, engine) -> GenerateCall:
    """SGLang GenerateReqInput -> GenerateCall; `engine` encodes text and validates requests."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    prompts, single, images = _prompts_and_images(body, engine)
    count, raw_params = len(prompts), body.get("sampling_params")
    if isinstance(raw_params, list) and single:
        raise InvalidRequest("sampling_params is a list but the request has a single prompt")
    parsed = _parse_each_sampling_params(raw_params, prompts, getattr(engine, "context_length", None))
    n = parsed[0][1]
    if any(k != n for _, k in parsed):
        raise InvalidRequest("sampling_params.n must be the same for every prompt (as in SGLang)")
    if count * n > MAX_SAMPLES_PER_CALL:
        raise InvalidRequest(
            f"{count} prompts x n={n} is {count * n} samples, over the {MAX_SAMPLES_PER_CALL} one "
            "/generate may ask for; split the batch into several calls"
        )
    if body.get("lora_path") is not None:  # merged into the weights: only the loaded adapter is served
        engine.check_lora_path(body["lora_path"])
    rids = _rids(body.get("rid"), count, single)
    return_lp = _per_prompt(body.get("return_logprob"), count, "return_logprob", False)
    start = _per_prompt(body.get("logprob_start_len"), count, "logprob_start_len", -1)
    top_k = _per_prompt(body.get("top_logprobs_num"), count, "top_logprobs_num", 0)
    chosen = _token_ids_logprob(body.get("token_ids_logprob"), count)
    entropy = _flag(body.get("return_entropy") or False, "return_entropy")
    routed = _flag(body.get("return_routed_experts") or False, "return_routed_experts")
    routed_start = _per_prompt(body.get("routed_experts_start_len"), count, "routed_experts_start_len", 0)
    requests = []
    for i, (ids, (params, _)) in enumerate(zip(prompts, parsed)):
        where = "input_ids" if single else f"input_ids[{i}]"
        for j in range(n):
            req = GenerationRequest(
                rid=rids[i] if n == 1 else f"{rids[i]}-{j}",
                input_ids=ids,
                params=params,
                return_logprob=_flag(return_lp[i] or False, "return_logprob"),
                logprob_start_len=_integer(start[i], "logprob_start_len", minimum=-1),
                top_logprobs_num=_integer(top_k[i] or 0, "top_logprobs_num", minimum=0),
                token_ids_logprob=chosen[i],
                return_entropy=entropy,
                return_routed_experts=routed,
                routed_experts_start_len=_integer(routed_start[i] or 0, "routed_experts_start_len", minimum=0),
                group_rid=rids[i] if n > 1 else None,
                images=images[i],
            )
            engine.validate(req, where)
            requests.append(req)
    options = {
        key: _flag(body.get(key) or False, key)
        for key in (
            "stream",
            "return_text_in_logprobs",
            "return_flat_raw_top_logprobs",
            "return_flat_raw_top_logprobs_b64",
            "return_prompt_token_ids",
        )
    }
    if options["return_flat_raw_top_logprobs_b64"] and not options["return_flat_raw_top_logprobs"]:
        raise InvalidRequest("return_flat_raw_top_logprobs_b64 needs return_flat_raw_top_logprobs=true (as in SGLang)")
    return GenerateCall(
        requests,
        single and n == 1,
        options["stream"],
        options["return_text_in_logprobs"],
        options["return_flat_raw_top_logprobs"],
        options["return_flat_raw_top_logprobs_b64"],
        options["return_prompt_token_ids"],
    )
