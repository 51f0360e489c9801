"""The `tensor` transport with a trainer over several hosts: the lowest trainer rank of each host
sends to the engines on its host (shared-memory / CUDA IPC handles open only there), and a sync
that fails on one host's engine leaves every host's engines on their previous weights.

Loopback gives one machine several hosts: Linux routes all of 127.0.0.0/8 to lo, so trainer ranks
reporting 127.0.0.2 / 127.0.0.3 and engines listening there are on two hosts to the bridge. The
trainer's export is played by a checkpoint read on every rank (every full HF tensor on every rank,
one collective per tensor, as MegatronEngine.export_weights yields them): what the transport
does with the stream is what is tested, not Megatron's gathers (tests/bridge/test_bridge.py).

Bit-exact reference: an engine started from the checkpoint the trainer sends (seed 1) scores the
prompt with the same code, so engines that received every weight answer the same log-probs, bit
for bit; before the sync (seed 0) they differ.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch

from megarl.bridge import WeightSyncError
from megarl.bridge.hosts import senders_by_host
from tests._dist import run_ranks

BUCKET = 64 * 1024  # several buckets per sync of the tiny model
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.3"]  # trainer rank -> its host: rank 2 is not a leader
TOKENS = [2, 10, 11, 12, 13, 14, 15, 3]


# ---- which rank sends where (pure) ---------------------------------------------------------------
def test_the_lowest_rank_of_each_host_sends_to_the_engines_there():
    plan = senders_by_host(
        ["10.0.0.2", "10.0.0.1", "10.0.0.2", "10.0.0.1"],
        ["http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.1:30001"],
    )
    assert plan == {1: ["http://10.0.0.1:30000", "http://10.0.0.1:30001"], 0: ["http://10.0.0.2:30000"]}


def test_a_url_by_name_is_on_the_host_of_the_rank_at_its_ip():
    assert senders_by_host(["127.0.0.1", "127.0.0.2"], ["http://localhost:8000"]) == {0: ["http://localhost:8000"]}


def test_an_engine_on_a_host_without_a_trainer_rank_is_refused_by_url():
    with pytest.raises(WeightSyncError, match=r"http://10\.0\.0\.9:1 .*bridge.transport=distributed"):
        senders_by_host(["10.0.0.1", "10.0.0.2"], ["http://10.0.0.1:1", "http://10.0.0.9:1"])


def test_an_engine_over_several_hosts_is_refused_by_url():
    """One request carries every TP rank's handle, made on one host: ranks elsewhere cannot open it."""
    from types import SimpleNamespace

    from megarl.bridge.tensor import _refuse_engines_over_hosts

    _refuse_engines_over_hosts([SimpleNamespace(url="http://10.0.0.1:1", nnodes=1)])
    with pytest.raises(WeightSyncError, match=r"http://10\.0\.0\.2:1 \(4 hosts\) spans hosts.*rollout.nnodes=1"):
        _refuse_engines_over_hosts(
            [SimpleNamespace(url="http://10.0.0.1:1", nnodes=1), SimpleNamespace(url="http://10.0.0.2:1", nnodes=4)]
        )


# ---- real processes: four engines, three trainer ranks on two hosts ------------------------------
class CheckpointSource:
    """A WeightSource whose export is a checkpoint's tensors, each broadcast from rank 0 first."""

    def __init__(self, path):
        from safetensors.torch import load_file

        self.tensors = load_file(str(next(path.glob("*.safetensors"))))

    def export_weights(self):
        import torch.distributed as dist

        for name, tensor in self.tensors.items():
            dist.broadcast(tensor, src=0)
            yield name, tensor


def _syncs(rank, checkpoints, servers):
    """Four syncs, each rank recording its stats, its error and which engines it posted buckets to."""
    from megarl.bridge import BridgeSpec, make_transport
    from megarl.rollout.client.client import RolloutClient

    posted: list[str] = []
    original = RolloutClient.update_weights_from_tensor

    def spy(self, *args, **kwargs):
        posted.append(self.base_url)
        return original(self, *args, **kwargs)

    RolloutClient.update_weights_from_tensor = spy
    source = CheckpointSource(checkpoints["new"])
    spec = BridgeSpec("tensor", (servers["a"], servers["b"]), BUCKET, timeout_s=60)
    bridge = make_transport(spec, rank, len(HOSTS), HOSTS[rank])
    steps = [
        ("v1", [servers["a"], servers["b"]], False),  # one engine on each host
        ("v2", [servers["b"]], True),  # a restarted engine, on rank 1's host only
        ("v3", [servers["a"], servers["ref"]], False),  # ref's host has no trainer rank
        ("v4", [servers["a"], servers["bad"]], False),  # bad refuses every bucket with expert weights
    ]
    out = []
    for version, urls, restarted in steps:
        if version == "v4":  # the old weights: had a's engine taken them, its answers would move
            source = CheckpointSource(checkpoints["old"])
        del posted[:]
        try:
            stats, error = bridge.sync(source, version, urls, restarted=restarted), None
        except WeightSyncError as exc:
            stats, error = None, str(exc)
        out.append({"stats": stats, "error": error, "posted": sorted(set(posted))})
    bridge.close()
    return out


def logprobs(url: str) -> torch.Tensor:
    body = {
        "input_ids": TOKENS,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
    }
    triples = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]["input_token_logprobs"]
    return torch.tensor([t[0] for t in triples[1:]], dtype=torch.float64)


def version(url: str) -> str:
    return httpx.get(f"{url}/get_weight_version", timeout=10).json()["weight_version"]


@pytest.fixture(scope="module")
def run(tiny_model_path, tmp_path_factory):
    """Engines a (host .2) and b (host .3) start on the seed-0 model; ref (host .4, no trainer
    rank) on the seed-1 model the trainer sends; bad (host .3) on a model with narrower experts."""
    from megarl.models.tiny import build_tiny_checkpoint
    from megarl.rollout.fleet.server_process import RolloutServerProcess

    base = tmp_path_factory.mktemp("hosts")
    checkpoints = {"old": tiny_model_path, "new": build_tiny_checkpoint(base / "seed1", seed=1)}
    narrow = build_tiny_checkpoint(base / "narrow", seed=0, moe_intermediate_size=32)
    models = {"a": tiny_model_path, "b": tiny_model_path, "ref": checkpoints["new"], "bad": narrow}
    hosts = {"a": "127.0.0.2", "b": "127.0.0.3", "ref": "127.0.0.4", "bad": "127.0.0.3"}
    processes = {k: RolloutServerProcess(models[k], host=hosts[k], torch_threads=1, seed=0) for k in models}
    try:
        with concurrent.futures.ThreadPoolExecutor(len(processes)) as pool:
            for future in [pool.submit(p.start) for p in processes.values()]:
                future.result()
        servers = {k: p.url for k, p in processes.items()}
        before = {k: logprobs(servers[k]) for k in ("a", "ref")}
        results = run_ranks(_syncs, len(HOSTS), checkpoints, servers, timeout=300)
        after = {k: logprobs(servers[k]) for k in ("a", "b", "ref")}
        yield {
            "servers": servers,
            "before": before,
            "after": after,
            "versions": {k: version(servers[k]) for k in ("a", "b")},
            "ranks": results,
            "bytes": sum(t.numel() * t.element_size() for t in CheckpointSource(checkpoints["new"]).tensors.values()),
        }
    finally:
        for process in processes.values():
            process.stop()


@pytest.mark.slow
def test_each_hosts_leader_alone_sends_and_both_engines_hold_the_trainers_weights(run):
    s = run["servers"]
    v1 = [r[0] for r in run["ranks"]]
    assert [r["posted"] for r in v1] == [[s["a"]], [s["b"]], []]
    assert [r["error"] for r in v1] == [None, None, None]
    assert v1[2]["stats"] == {}
    for stats in [r["stats"] for r in v1[:2]]:  # what one host received: every weight, once
        assert stats["bridge/hosts"] == 2 and stats["bridge/buckets"] > 1
        assert stats["bridge/bytes"] == run["bytes"]
    assert not torch.equal(run["before"]["a"], run["before"]["ref"])  # the sync has something to move
    assert torch.equal(run["after"]["a"], run["after"]["ref"])
    assert torch.equal(run["after"]["b"], run["after"]["ref"])


@pytest.mark.slow
def test_a_restarted_engine_on_one_host_is_synced_by_that_hosts_leader_alone(run):
    v2 = [r[1] for r in run["ranks"]]
    assert [r["posted"] for r in v2] == [[], [run["servers"]["b"]], []]
    assert [r["error"] for r in v2] == [None, None, None]
    # rank 0 (whose stats the trainer logs) sent nothing, and still reports the sync
    assert v2[0]["stats"]["bridge/hosts"] == 1 and v2[0]["stats"]["bridge/bytes"] == run["bytes"]
    assert run["versions"]["b"] == "v2"


@pytest.mark.slow
def test_an_engine_on_a_host_without_a_trainer_rank_fails_the_sync_on_every_rank(run):
    v3 = [r[2] for r in run["ranks"]]
    for r in v3:
        assert r["error"] is not None and f"no trainer rank runs on the host of {run['servers']['ref']}" in r["error"]
        assert r["posted"] == []  # refused before any engine was touched


@pytest.mark.slow
def test_a_failure_on_one_hosts_engine_leaves_both_hosts_on_their_old_weights(run):
    v4 = [r[3] for r in run["ranks"]]
    assert v4[0]["posted"] == [run["servers"]["a"]]  # a's engine was sent (staged) the new weights
    for r in v4:  # every rank learns it, naming the engine that refused
        assert r["error"] is not None and "keep serving their previous weights" in r["error"]
        assert run["servers"]["bad"] in r["error"]
    assert run["versions"]["a"] == "v1"
    assert torch.equal(run["after"]["a"], run["after"]["ref"])  # still v1's weights, not the old ones
