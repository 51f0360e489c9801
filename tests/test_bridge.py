"""Weight bridge: bucketing, and after a sync the server scores tokens as the trainer does.

Parity tolerance: 1e-4 absolute on fp32 log-probs (observed ~1e-6); before the sync the two
differ by far more than that, so the check is not vacuous.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from megarl.bridge.buckets import iter_buckets, with_last_flag
from tests._dist import run_ranks
from tests.test_megatron_engine import SEQ_ROWS, make_rows


def _named(sizes):
    return [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]


def test_buckets_respect_size_order_and_keep_every_tensor():
    named = _named([10, 10, 10, 30, 5, 5])  # 4 bytes per element
    buckets = list(iter_buckets(named, bucket_bytes=80))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert all(sum(t.numel() * 4 for _, t in b) <= 80 or len(b) == 1 for b in buckets)


def test_oversized_tensor_travels_alone_and_bad_size_is_rejected():
    buckets = list(iter_buckets(_named([5, 100, 5]), bucket_bytes=40))
    assert [[n for n, _ in b] for b in buckets] == [["t0"], ["t1"], ["t2"]]
    with pytest.raises(ValueError, match="bucket_size_mb"):
        list(iter_buckets(_named([1]), bucket_bytes=0))


def test_with_last_flag_marks_only_the_last():
    assert list(with_last_flag("abc")) == [("a", False), ("b", False), ("c", True)]
    assert list(with_last_flag([])) == []


def server_response_logprobs(url: str) -> torch.Tensor:
    """The server's log-probs of each SEQ_ROWS response token, via input_token_logprobs."""
    rows = make_rows()
    out = torch.zeros_like(rows["response_mask"])
    for i, (prompt, response) in enumerate(SEQ_ROWS):
        body = httpx.post(f"{url}/generate", json={
            "input_ids": prompt + response, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}, timeout=60).json()
        triples = body["meta_info"]["input_token_logprobs"]
        for j in range(len(response)):
            out[i, j] = triples[len(prompt) + j][0]
    return out


def _train_then_sync(rank, model_path, url, transport, tp, ep, tmp_dir):
    """Two (update, sync) rounds with one sender: the second proves it can be reused."""
    from megarl.bridge import make_weight_sender
    from tests.test_megatron_engine import _engine

    engine = _engine(model_path, tp, ep, train=True)
    rows = make_rows()
    spec = {"transport": transport, "server_urls": [url], "bucket_bytes": 64 * 1024,
            "disk_dir": str(tmp_dir)}
    sender = make_weight_sender(spec) if rank == 0 else None
    stats = {}
    for version in ("v1", "v2"):
        # a real optimizer step so the trainer's weights differ from the server's
        engine.train_mini_batch(rows, lambda lp, ent, mb: ((lp * mb["advantages"]).sum(),
                                                           mb["response_mask"].sum(), {}))
        if sender is not None:
            stats = sender.send(engine.export_weights(), version)
        else:
            for _ in engine.export_weights():  # take part in the gathers
                pass
    if sender is not None:
        sender.close()
    return {"log_probs": engine.compute_log_prob(rows)["log_probs"], "stats": stats}


@pytest.mark.parametrize("transport,tp,ep", [("tensor", 2, 1), ("tensor", 1, 2), ("disk", 2, 1)])
def test_server_matches_trainer_after_sync(tiny_model_path, tmp_path, transport, tp, ep):
    from megarl.rollout.launcher import RolloutServerProcess

    mask = make_rows()["response_mask"].bool()
    with RolloutServerProcess(tiny_model_path, torch_threads=1) as server:
        initial = server_response_logprobs(server.url)
        results = run_ranks(_train_then_sync, 2, tiny_model_path, server.url, transport, tp, ep,
                            tmp_path)
        synced = server_response_logprobs(server.url)
        version = httpx.get(f"{server.url}/get_model_info", timeout=10).json().get("weight_version")
    trainer = results[0]["log_probs"]
    assert (trainer - initial)[mask].abs().max() > 1e-3, "the update did not change the weights"
    torch.testing.assert_close(synced[mask], trainer[mask], atol=1e-4, rtol=0)
    assert version == "v2"
    if transport == "tensor":
        assert results[0]["stats"]["bridge/buckets"] > 1  # 64 KiB buckets: several per sync
    else:  # the superseded checkpoint is gone, the live one stays
        assert sorted(p.name for p in tmp_path.iterdir()) == ["weights_v2"]


def test_flattened_bucket_aligns_mixed_dtypes():
    from megarl.rollout.weights_codec import deserialize_flattened_bucket, serialize_flattened_bucket

    # a 6-byte bf16 tensor before a float32 one: unaligned packing cannot view the second
    named = [("a", torch.randn(3).bfloat16()), ("b", torch.randn(4)), ("c", torch.arange(5))]
    out = deserialize_flattened_bucket(serialize_flattened_bucket(named))
    assert [n for n, _ in out] == ["a", "b", "c"]
    for (_, got), (_, want) in zip(out, named):
        assert got.dtype == want.dtype and torch.equal(got, want)
