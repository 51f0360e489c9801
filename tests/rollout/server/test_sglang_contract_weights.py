"""Weight payloads both ways against SGLang's own code: what megarl's bridge sends to
/update_weights_from_tensor decodes with SGLang's MultiprocessingSerializer (and its
FlattenedTensorBucket) into the same tensors; what SGLang's serializer and bucket build (verl's and
slime's payloads) loads into the embedded server through megarl's allow-list unpickler."""

from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors.torch import load_file

from megarl.wire.weights_codec import (
    pack_flattened_bucket,
    serialize,
    serialize_flattened_bucket,
    serialize_named_tensors,
)
from tests.rollout import sglang_upstream as upstream

torch.set_num_threads(1)
PROMPT = [2, 10, 11, 12, 13, 3]
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def _named() -> list:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=gen)
    return [
        ("model.layers.0.self_attn.q_proj.weight", base),
        ("model.layers.0.mlp.gate.weight", base.bfloat16()),
        ("model.norm.weight", base[0].half()),
        ("view", base[1:, ::2]),
        ("transposed", base.t()),
        ("ids", torch.arange(5)),
        ("mask", base > 0),
        ("scalar", torch.tensor(2.5)),
    ]


def _assert_same(decoded, named) -> None:
    assert [n for n, _ in decoded] == [n for n, _ in named]
    for (name, got), (_, want) in zip(decoded, named):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name


# ---- megarl -> SGLang ------------------------------------------------------------------------------
def test_named_tensor_payloads_decode_with_sglangs_serializer():
    named = _named()
    _assert_same(upstream.serializer().deserialize(serialize_named_tensors(named)), named)


def test_flattened_buckets_decode_with_sglangs_serializer_and_bucket():
    named = [(n, t) for n, t in _named() if t.dim() > 0]  # SGLang's bucket flattens each tensor
    obj = upstream.serializer().deserialize(serialize_flattened_bucket(named))
    bucket = upstream.flattened_tensor_bucket()(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
    _assert_same(bucket.reconstruct_tensors(), named)


def test_the_bridges_reused_shared_buffer_decodes_with_sglang():
    """TensorTransport packs each bucket into a larger buffer in shared memory and sends a view."""
    named = [(n, t) for n, t in _named() if t.dim() > 0]
    buffer = torch.empty(4096, dtype=torch.uint8).share_memory_()
    flat, metadata = pack_flattened_bucket(named, out=buffer)
    obj = upstream.serializer().deserialize(serialize({"flattened_tensor": flat, "metadata": metadata}))
    bucket = upstream.flattened_tensor_bucket()(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
    _assert_same(bucket.reconstruct_tensors(), named)


# ---- SGLang -> the embedded server ------------------------------------------------------------------
@contextlib.contextmanager
def _file_system_sharing():
    """SGLang's serializer shares CPU storage by torch's default strategy; on Linux that is
    file_descriptor, whose handles the allow-list refuses (an address the payload names).
    Senders on CPU use file_system; CUDA payloads (CUDA IPC handles) need no switch."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


@pytest.fixture(scope="module")
def checkpoint(tiny_model_path) -> dict:
    return load_file(str(next(tiny_model_path.glob("*.safetensors"))))


def _tensor_body(payloads: list, **fields) -> dict:
    """A body from SGLang's UpdateWeightsFromTensorReqInput, as its HTTP clients post it."""
    request = upstream.io_struct()["UpdateWeightsFromTensorReqInput"](serialized_named_tensors=[b""], **fields)
    return {**upstream.struct_asdict(request), "serialized_named_tensors": payloads}


def _logprobs(client) -> list:
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return [row[0] for row in response.json()["meta_info"]["output_token_logprobs"]]


def _update(client, body) -> None:
    response = client.post("/update_weights_from_tensor", json=body)
    assert response.status_code == 200 and response.json()["success"], response.text


def _round_trip(client, checkpoint, payload_of, load_format=None):
    """Perturb the final norm with SGLang's payload, then restore it: the answers move and come back."""
    before = _logprobs(client)
    norm = checkpoint["model.norm.weight"]
    serializer = upstream.serializer()
    with _file_system_sharing():
        perturbed = serializer.serialize(payload_of([("model.norm.weight", norm * 3.0)]), output_str=True)
        restored = serializer.serialize(payload_of([("model.norm.weight", norm.clone())]), output_str=True)
    _update(client, _tensor_body([perturbed], load_format=load_format, weight_version="contract-1"))
    moved = _logprobs(client)
    restore = dict(flush_cache=False, abort_all_requests=True, selector="target", torch_empty_cache=True)
    _update(client, _tensor_body([restored], load_format=load_format, **restore))
    assert moved != before and _logprobs(client) == pytest.approx(before, abs=1e-6)


def test_sglang_serialized_named_tensors_load_into_the_embedded_server(client, checkpoint):
    _round_trip(client, checkpoint, lambda named: named)


def test_sglang_flattened_buckets_load_into_the_embedded_server(client, checkpoint):
    bucket_class = upstream.flattened_tensor_bucket()

    def payload_of(named):
        bucket = bucket_class(named_tensors=named)
        return {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}

    _round_trip(client, checkpoint, payload_of, load_format="flattened_bucket")


def test_sglangs_default_cpu_sharing_is_refused_with_the_reason(client, checkpoint):
    payload = upstream.serializer().serialize([("model.norm.weight", checkpoint["model.norm.weight"])], output_str=True)
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        pytest.fail("this test expects torch's Linux default sharing strategy, file_descriptor")
    response = client.post("/update_weights_from_tensor", json=_tensor_body([payload]))
    assert response.status_code == 400 and "file_descriptor sharing strategy" in response.json()["message"]


def test_a_draft_model_selector_is_refused_naming_it(client, checkpoint):
    with _file_system_sharing():
        payload = upstream.serializer().serialize(
            [("model.norm.weight", checkpoint["model.norm.weight"])], output_str=True
        )
    response = client.post("/update_weights_from_tensor", json=_tensor_body([payload], selector="draft"))
    assert response.status_code == 400 and "selector='draft'" in response.json()["message"]
