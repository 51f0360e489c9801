"""megarl's /generate field tables against SGLang's own GenerateReqInput and SamplingParams (the
pinned release, tests/rollout/sglang_upstream.py), and the embedded server against bodies that
SGLang's classes build: every field at its default and at another value."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megarl.rollout.server.sglang_fields import GENERATE_FIELDS, NOT_IN_PINNED, OFF_ONLY, SAMPLING_FIELDS
from tests.rollout import sglang_upstream as upstream

torch.set_num_threads(1)
PROMPT = [2, 10, 11, 12, 13, 3]
SHORT = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


def _with_wire_fields(dataclass_fields: dict, wire_struct) -> dict:
    """The dataclass's {field: default} plus the fields only SGLang's HTTP JSON contract
    (sglang.api.v1) has, at that contract's default."""
    wire = upstream.fields_and_defaults(wire_struct)
    return {**{k: v for k, v in wire.items() if k not in dataclass_fields}, **dataclass_fields}


def upstream_generate() -> dict:
    own = upstream.fields_and_defaults(upstream.io_struct()["GenerateReqInput"])
    return _with_wire_fields(own, upstream.api_types().GenerateRequest)


def upstream_sampling() -> dict:
    own = upstream.fields_and_defaults(upstream.sampling_params_class())
    return _with_wire_fields(own, upstream.api_types().SamplingParams)


def _names(get) -> list[str]:
    """Field names to parametrize over; without sglang one placeholder, whose test then fails with
    the install line (collection itself must not fail: that would stop the whole suite)."""
    try:
        return sorted(get())
    except pytest.fail.Exception:
        return ["(sglang is not installed)"]


def _post(client, body: dict):
    return client.post("/generate", json=body)


# ---- the tables --------------------------------------------------------------------------------
def test_every_generate_req_input_field_is_in_megarls_table():
    """GenerateReqInput's fields and those of the HTTP JSON contract's GenerateRequest."""
    missing = sorted(set(upstream_generate()) - set(GENERATE_FIELDS))
    assert not missing, f"SGLang {upstream.PINNED}'s GenerateReqInput has fields megarl's table lacks: {missing}"


def test_every_field_of_megarls_generate_table_is_upstream_or_named_as_another_release():
    extra = sorted(set(GENERATE_FIELDS) - set(upstream_generate()) - set(NOT_IN_PINNED))
    assert not extra, f"megarl's GENERATE_FIELDS has fields SGLang {upstream.PINNED} lacks: {extra}"


def test_fields_named_as_another_release_are_really_absent_from_the_pinned_one():
    present = sorted(set(NOT_IN_PINNED) & set(upstream_generate()))
    assert not present, f"NOT_IN_PINNED names fields that GenerateReqInput {upstream.PINNED} has: {present}"
    assert set(NOT_IN_PINNED) <= set(GENERATE_FIELDS)


def test_sampling_params_fields_match_megarls_table_both_ways():
    theirs, ours = set(upstream_sampling()), set(SAMPLING_FIELDS)
    assert not theirs - ours, f"SamplingParams fields megarl's table lacks: {sorted(theirs - ours)}"
    assert not ours - theirs, f"megarl's SAMPLING_FIELDS has fields SGLang lacks: {sorted(ours - theirs)}"


def _default_mismatches(table, theirs) -> dict:
    return {
        name: (rule.default, theirs[name])
        for name, rule in table.items()
        if name in theirs and (rule.default != theirs[name] or type(rule.default) is not type(theirs[name]))
    }


def test_defaults_agree_with_upstream():
    assert _default_mismatches(GENERATE_FIELDS, upstream_generate()) == {}
    assert _default_mismatches(SAMPLING_FIELDS, upstream_sampling()) == {}


# ---- bodies built by SGLang's classes ------------------------------------------------------------
def _sglang_body(**kwargs) -> dict:
    """A /generate body as SGLang's Python clients build it: dataclasses.asdict of a GenerateReqInput
    whose sampling_params are a SamplingParams' fields (after its own __post_init__)."""
    sampling = upstream.sampling_params_class()(**kwargs.pop("sampling", SHORT))
    request = upstream.io_struct()["GenerateReqInput"](sampling_params=upstream.struct_asdict(sampling), **kwargs)
    return dataclasses.asdict(request)


def test_a_generate_req_input_with_every_field_at_its_default_is_answered(client):
    body = _sglang_body(input_ids=PROMPT)
    own = upstream.fields_and_defaults(upstream.io_struct()["GenerateReqInput"])
    assert set(body) == set(own) and set(body["sampling_params"]) <= set(upstream_sampling())
    out = _post(client, body)
    assert out.status_code == 200, out.text
    answer = out.json()
    assert len(answer["output_ids"]) == 3 and answer["meta_info"]["prompt_tokens"] == len(PROMPT)


def test_a_full_generate_req_input_and_a_minimal_body_give_the_same_tokens(client):
    full = _post(client, _sglang_body(input_ids=PROMPT, return_logprob=True)).json()
    plain = _post(client, {"input_ids": PROMPT, "sampling_params": SHORT, "return_logprob": True}).json()
    assert full["output_ids"] == plain["output_ids"]
    assert full["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]


# Values other than the default for fields whose parsers check them: each a valid request.
HONOURED_VALUES = {
    "text": {"text": "hello world"},
    "input_ids": {"input_ids": [PROMPT, PROMPT[:4]]},
    "rid": {"rid": "contract-1"},
    "sampling_params": {"sampling_params": {**SHORT, "temperature": 0.7, "sampling_seed": 3}},
    "return_logprob": {"return_logprob": True},
    "logprob_start_len": {"return_logprob": True, "logprob_start_len": 2},
    "top_logprobs_num": {"return_logprob": True, "top_logprobs_num": 2},
    "token_ids_logprob": {"return_logprob": True, "token_ids_logprob": [3, 5]},
    "return_text_in_logprobs": {"return_logprob": True, "return_text_in_logprobs": True},
    "stream": {"stream": True},
    "return_flat_raw_top_logprobs": {
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_flat_raw_top_logprobs": True,
    },
    "return_flat_raw_top_logprobs_b64": {
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_flat_raw_top_logprobs": True,
        "return_flat_raw_top_logprobs_b64": True,
    },
    "return_entropy": {"return_entropy": True},
    "return_prompt_token_ids": {"return_prompt_token_ids": True},
    "return_routed_experts": {"return_routed_experts": True},
    "routed_experts_start_len": {"return_routed_experts": True, "routed_experts_start_len": 2},
    # the per-prompt form, naming no adapter (none is loaded here; tests/rollout/server/test_lora_adapter.py
    # loads one and names it)
    "lora_path": {"lora_path": [None]},
}


def _other_value(default):
    if isinstance(default, bool):
        return not default
    return 7 if default is None else "other"


@pytest.mark.parametrize("name", _names(upstream_generate))
def test_every_generate_req_input_field_at_another_value_is_honoured_ignored_or_refused_by_name(client, name):
    upstream_generate()
    rule = GENERATE_FIELDS.get(name)
    assert rule is not None, f"GenerateReqInput.{name} is not in megarl's GENERATE_FIELDS"
    body = {"input_ids": PROMPT, "sampling_params": SHORT}
    if rule.kind == OFF_ONLY:
        value = _other_value(rule.default)
        response = _post(client, {**body, name: value})
        assert response.status_code == 400 and f"{name}={value!r}" in response.json()["error"]["message"]
        return
    extra = HONOURED_VALUES.get(name, {name: _other_value(rule.default)})
    if "text" in extra:
        body.pop("input_ids")
    response = _post(client, {**body, **extra})
    assert response.status_code == 200, f"{name}: {response.text}"


SAMPLING_VALUES = {
    "max_new_tokens": 2,
    "stop": ["zz"],
    "stop_token_ids": [4],
    "stop_regex": "z+",
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.05,
    "frequency_penalty": 0.3,
    "presence_penalty": 0.2,
    "repetition_penalty": 1.1,
    "min_new_tokens": 1,
    "n": 2,
    "stream_interval": 2,
    "logit_bias": {"5": 1.0},
    "sampling_seed": 11,
    "custom_params": {"a": 1},
}


@pytest.mark.parametrize("name", _names(upstream_sampling))
def test_every_sampling_params_field_at_another_value_is_honoured_ignored_or_refused_by_name(client, name):
    upstream_sampling()
    rule = SAMPLING_FIELDS.get(name)
    assert rule is not None, f"SamplingParams.{name} is not in megarl's SAMPLING_FIELDS"
    value = SAMPLING_VALUES.get(name, _other_value(rule.default))
    response = _post(client, {"input_ids": PROMPT, "sampling_params": {**SHORT, name: value}})
    if rule.kind == OFF_ONLY:
        assert response.status_code == 400, response.text
        assert f"sampling_params.{name}={value!r}" in response.json()["error"]["message"]
    else:
        assert response.status_code == 200, f"{name}={value!r}: {response.text}"
