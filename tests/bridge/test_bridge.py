"""Weight bridge: after a sync the engines score tokens exactly as the trainer does, for every
transport and trainer layout; a failed sync leaves the engines on their previous weights.

Parity tolerance: 1e-4 absolute on fp32 log-probs (the required bound; observed ~1e-6). Before each
sync the trainer takes an optimizer step (lr 1e-3), which moves the log-probs by far more than the
tolerance, so a sync that delivered nothing (or stale weights) fails the check.

The matrix, pruned to what adds coverage (one Megatron start per trainer layout, each syncing to a
tp=1 and a tp=2 engine at once, so every transport also meets two engines of different layouts):
  trainer TP=2 : tensor, disk, distributed, reshard
  trainer EP=2 : tensor, distributed, reshard   (disk reads export_weights, as tensor does: no new path)
  trainer PP=2 : tensor, distributed, reshard
Distributed and reshard sync twice in one layout (EP=2) to show their groups and plan are reused.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch

from megarl.bridge.buckets import iter_buckets, with_last_flag
from tests._dist import run_ranks
from tests.engine.test_megatron_engine import SEQ_ROWS, make_rows

TOL = 1e-4
BUCKET = 64 * 1024  # several buckets / messages per sync of the tiny model


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


def test_spec_names_bad_transport_and_keeps_transport_across_url_changes():
    from megarl.bridge import BridgeSpec

    with pytest.raises(ValueError, match="bridge.transport='nccl'"):
        BridgeSpec("nccl", ("http://a",), 1)
    with pytest.raises(ValueError, match="disk_dir"):
        BridgeSpec("disk", ("http://a",), 1)
    a = BridgeSpec("reshard", ("http://a",), 1024)
    assert a.same_transport(BridgeSpec("reshard", ("http://b", "http://c"), 1024))
    assert not a.same_transport(BridgeSpec("reshard", ("http://a",), 2048))


def server_response_logprobs(url: str) -> torch.Tensor:
    """The server's log-probs of each SEQ_ROWS response token, via input_token_logprobs."""
    rows = make_rows()
    out = torch.zeros_like(rows["response_mask"])
    for i, (prompt, response) in enumerate(SEQ_ROWS):
        body = httpx.post(
            f"{url}/generate",
            json={
                "input_ids": prompt + response,
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            },
            timeout=60,
        ).json()
        triples = body["meta_info"]["input_token_logprobs"]
        for j in range(len(response)):
            out[i, j] = triples[len(prompt) + j][0]
    return out


def _step(engine, rows) -> None:
    """One real optimizer step, so the trainer's weights differ from the engines'."""
    engine.train_mini_batch(rows, lambda lp, ent, mb: ((lp * mb["advantages"]).sum(), mb["response_mask"].sum(), {}))


def _sync_rounds(rank, model_path, urls, layout, rounds, tmp_dir):
    """For each transport in `rounds`: step, sync to every engine, record trainer and engine log-probs."""
    import torch.distributed as dist

    from megarl.bridge import BridgeSpec, make_transport
    from tests.engine.test_megatron_engine import _engine

    engine = _engine(model_path, train=True, **layout)
    rows = make_rows()
    # what reshard plans from: every rank's HF boxes, and the full tensors they must rebuild
    pieces = [(p.name, p.box, p.fetch().clone()) for p in engine.local_pieces()]
    full = {name: t.clone() for name, t in engine.export_weights()}
    transports, out = {}, [{"pieces": pieces, "full": full if rank == 0 else None}]
    for version, name in enumerate(rounds, start=1):
        if name not in transports:
            # "tensor-whole": every weight in one bucket, applied by one request with no commit
            kind, bucket = ("tensor", 2**26) if name == "tensor-whole" else (name, BUCKET)
            spec = BridgeSpec(kind, tuple(urls), bucket, disk_dir=str(tmp_dir), timeout_s=120)
            transports[name] = make_transport(spec, dist.get_rank(), dist.get_world_size(), "127.0.0.1")
        _step(engine, rows)
        stats = transports[name].sync(engine, f"v{version}", urls)
        trainer = engine.compute_log_prob(rows)  # only the last pipeline stage has them
        record = {"transport": name, "stats": stats, "trainer": None if trainer is None else trainer["log_probs"]}
        if rank == 0:
            record["engines"] = [server_response_logprobs(u) for u in urls]
            record["versions"] = [
                httpx.get(f"{u}/get_weight_version", timeout=10).json()["weight_version"] for u in urls
            ]
        out.append(record)
    for transport in transports.values():
        transport.close()
    return out


@pytest.fixture(scope="module")
def engines(tiny_model_path, tmp_path_factory):
    """A tp=1 and a tp=2 embedded engine, shared by the module's tests."""
    from megarl.rollout.fleet.server_process import RolloutServerProcess

    disk = ("--weight-dirs", str(tmp_path_factory.getbasetemp()))  # the disk transport writes under tmp_path
    servers = [
        RolloutServerProcess(tiny_model_path, torch_threads=1, seed=0, extra_args=disk),
        RolloutServerProcess(tiny_model_path, torch_threads=1, seed=0, extra_args=("--tp", "2", *disk)),
    ]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(s.start) for s in servers]:
                future.result()
        yield [s.url for s in servers]
    finally:
        for server in servers:
            server.stop()


@pytest.mark.parametrize(
    "layout,rounds",
    [
        (dict(tp=2, ep=1, pp=1), ["tensor", "disk", "distributed", "reshard"]),
        (dict(tp=1, ep=2, pp=1), ["tensor", "distributed", "distributed", "reshard", "reshard"]),
        (dict(tp=1, ep=1, pp=2), ["tensor", "distributed", "reshard", "tensor-whole"]),
    ],
    ids=["trainer-tp2", "trainer-ep2", "trainer-pp2"],
)
def test_engines_match_trainer_after_every_sync(engines, tiny_model_path, tmp_path, layout, rounds):
    mask = make_rows()["response_mask"].bool()
    before = [server_response_logprobs(u) for u in engines]
    results = run_ranks(_sync_rounds, 2, tiny_model_path, engines, layout, rounds, tmp_path)
    _check_pieces_rebuild_the_model([r.pop(0) for r in results])
    previous = before
    for i, name in enumerate(rounds):
        trainer = next(r[i]["trainer"] for r in results if r[i]["trainer"] is not None)
        record = results[0][i]
        assert record["versions"] == [f"v{i + 1}"] * len(engines), name
        for before_sync, synced in zip(previous, record["engines"]):
            assert (trainer - before_sync)[mask].abs().max() > 10 * TOL, f"{name}: the step did not move the weights"
            torch.testing.assert_close(synced[mask], trainer[mask], atol=TOL, rtol=0, msg=f"{name} round {i}")
        previous = record["engines"]
    by_transport = {r["transport"]: r["stats"] for r in results[0]}
    if "disk" in by_transport:  # the superseded checkpoint is gone, the live one stays
        assert [p.name for p in tmp_path.iterdir()] == [f"weights_v{rounds.index('disk') + 1}"]
    assert by_transport["tensor"]["bridge/buckets"] > 1
    if "tensor-whole" in by_transport:
        assert by_transport["tensor-whole"]["bridge/buckets"] == 1


def _check_pieces_rebuild_the_model(per_rank: list[dict]) -> None:
    """The boxes every rank says it can produce from its own shard (shards.local_hf_pieces, via
    mbridge's layouts) put back together equal the gathered export, bit for bit, with no gaps."""
    full = per_rank[0]["full"]
    rebuilt = {name: torch.full_like(t, float("nan")) for name, t in full.items()}
    for record in per_rank:
        for name, box, values in record["pieces"]:
            rebuilt[name][tuple(slice(a, b) for a, b in box)] = values
    assert rebuilt.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(rebuilt[name], tensor), name


def test_reshard_moves_exactly_the_bytes_each_rollout_rank_owns(engines, tiny_model_path):
    """One reshard sync from an EP=2 trainer: the plan's bytes equal the engines' shard bytes."""
    from math import prod

    results = run_ranks(_sync_rounds, 2, tiny_model_path, engines, dict(tp=1, ep=2, pp=1), ["reshard"], None)
    stats = results[0][1]["stats"]
    layouts = [httpx.get(f"{u}/get_parallelism_config", timeout=10).json() for u in engines]
    owned = [
        sum(prod(p["local_shape"]) * 4 for p in rank["params"].values())
        for layout in layouts
        for rank in layout["ranks"]
    ]
    full = sum(prod(p["global_shape"]) * 4 for p in layouts[0]["ranks"][0]["params"].values())
    assert stats["bridge/bytes"] == sum(owned)
    assert stats["bridge/bytes_per_rollout_rank_max"] == max(owned) == full  # the tp=1 engine holds it all
    assert max(owned[1:]) < 0.75 * full  # each tp=2 rank gets its half of the split tensors only
    # both trainer ranks send (EP owners and data-parallel copies share the work)
    assert all(r[1]["stats"]["bridge/bytes_sent"] > 0 for r in results)


def _die_mid_sync(rank, model_path, urls, transport, tmp_dir):
    """v1 syncs; then trainer rank 1 dies in the middle of the v2 sync. Rank 0 reports."""
    import os

    import torch.distributed as dist

    from megarl.bridge import BridgeSpec, WeightSyncError, make_transport
    from tests.engine.test_megatron_engine import _engine

    engine = _engine(model_path, train=True, tp=1, ep=2)
    rows = make_rows()
    spec = BridgeSpec(transport, tuple(urls), BUCKET, timeout_s=20)
    bridge = make_transport(spec, rank, dist.get_world_size(), "127.0.0.1")
    _step(engine, rows)
    bridge.sync(engine, "v1", urls)
    v1 = [server_response_logprobs(u) for u in urls] if rank == 0 else None
    _step(engine, rows)
    if rank == 1:  # die after the engines started receiving from this rank, before they have it all
        if transport == "distributed":
            original, calls = bridge._post_bucket, []

            def post_then_die(bucket, version):
                calls.append(original(bucket, version))
                if len(calls) == 2:  # holding the bucket lock, the engines waiting on its broadcast
                    os._exit(1)
                return calls[-1]

            bridge._post_bucket = post_then_die
        else:
            original = bridge._group.send

            def send_then_die(tensor, dst, tag):
                original(tensor, dst, tag).wait()
                os._exit(1)

            bridge._group.send = send_then_die
    try:
        bridge.sync(engine, "v2", urls)
        error = None
    except WeightSyncError as exc:
        error = str(exc)
    return {
        "error": error,
        "v1": v1,
        "after": [server_response_logprobs(u) for u in urls],
        "versions": [httpx.get(f"{u}/get_weight_version", timeout=10).json()["weight_version"] for u in urls],
    }


@pytest.mark.parametrize("transport", ["distributed", "reshard"])
def test_a_sender_dying_mid_sync_fails_it_and_engines_keep_their_weights(engines, tiny_model_path, transport):
    rank0, rank1 = run_ranks(_die_mid_sync, 2, tiny_model_path, engines, transport, None, may_die=(1,))
    assert rank1 is None, "rank 1 was meant to die"
    assert rank0["error"] is not None and "v2 failed" in rank0["error"], rank0["error"]
    assert "keep serving their previous weights" in rank0["error"]
    assert rank0["versions"] == ["v1", "v1"]
    for v1, after in zip(rank0["v1"], rank0["after"]):
        assert torch.equal(v1, after)  # not one bucket of v2 was applied
    # the engines still serve, unchanged, to anyone
    for url, v1 in zip(engines, rank0["v1"]):
        assert torch.equal(server_response_logprobs(url), v1)


def _resync_on_the_same_url(rank, model_path, transport, port, tmp_dir):
    """v1 reaches an engine on a fixed port; the engine is SIGKILLed and a new one comes up on the
    same URL (a fleet restart with rollout.port set, or a free port the OS hands out again); the
    fleet's resync (restarted=True) and the next ordinary sync must reach the new process."""
    import os
    import signal

    import torch.distributed as dist

    from megarl.bridge import BridgeSpec, make_transport
    from megarl.rollout.fleet.server_process import RolloutServerProcess
    from tests.engine.test_megatron_engine import _engine

    url = f"http://127.0.0.1:{port}"
    server = RolloutServerProcess(model_path, port=port, torch_threads=1, seed=0) if rank == 0 else None
    engine, rows = _engine(model_path, train=True, tp=1, ep=2), make_rows()
    bridge = make_transport(
        BridgeSpec(transport, (url,), BUCKET, timeout_s=30), rank, dist.get_world_size(), "127.0.0.1"
    )
    try:
        if rank == 0:
            server.start()
        dist.barrier()
        _step(engine, rows)
        bridge.sync(engine, "v1", [url])
        if rank == 0:
            os.kill(server.process.pid, signal.SIGKILL)
            server.process.wait()
            server.start()  # the same port: requested explicitly
        dist.barrier()
        bridge.sync(engine, "v1", [url], restarted=True)  # the resync of the restarted engine
        resynced = server_response_logprobs(url) if rank == 0 else None
        _step(engine, rows)
        bridge.sync(engine, "v2", [url])
        trainer = engine.compute_log_prob(rows)
        return {
            "resynced": resynced,
            "trainer": None if trainer is None else trainer["log_probs"],
            "engine": server_response_logprobs(url) if rank == 0 else None,
            "version": httpx.get(f"{url}/get_weight_version", timeout=10).json()["weight_version"],
        }
    finally:
        bridge.close()
        if server is not None:
            server.stop()


@pytest.mark.parametrize("transport", ["distributed", "reshard"])
def test_an_engine_restarted_on_its_predecessors_url_is_resynced(tiny_model_path, tmp_path, transport):
    """Groups and plans are kept per engine URL; a restart on the same URL must not inherit them
    (the new process never joined the old group: the resync failed before restarted=True)."""
    from megarl.procs.net import free_port

    mask = make_rows()["response_mask"].bool()
    results = run_ranks(_resync_on_the_same_url, 2, tiny_model_path, transport, free_port(), tmp_path)
    trainer = next(r["trainer"] for r in results if r["trainer"] is not None)
    assert results[0]["version"] == "v2"
    assert (trainer - results[0]["resynced"])[mask].abs().max() > 10 * TOL  # v2 moved past the resync
    torch.testing.assert_close(results[0]["engine"][mask], trainer[mask], atol=TOL, rtol=0)
