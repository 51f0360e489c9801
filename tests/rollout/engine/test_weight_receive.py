"""The engine's side of the weight-update protocol, on a tp=1 and a tp=2 embedded server at once,
with the trainer's side played here (tests/_trainer_side.py): update groups, distributed
broadcasts (per tensor and one flattened bucket), reshard messages from two senders, the
deferred-update stage (commit, wrong version, abort), a sender that dies or closes its group
mid-update, and refusals that name the tensor after taking its bytes.

Parity: after a committed update each server's input log-probs equal a single-process Hugging
Face model holding the same weights within 1e-5. The weights are fp32 and the HF model runs the
same kernels; what remains is summation order (tp=2's row-parallel all-reduce, left padding in
the server's batch), ~1e-6 here, while every update moves the log-probs by more than 1e-3 (checked).

The two servers share the module and every group; each test that changes weights changes both
alike and records the new weights in `reference`.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys

import httpx
import pytest
import torch

from megarl.rollout.client.client import RolloutClient, RolloutRequestError
from megarl.rollout.fleet.server_process import RolloutServerProcess
from megarl.wire.weights_codec import serialize_flattened_bucket
from tests._trainer_side import (
    TRAINER_TIMEOUT_S,
    TrainerGroup,
    broadcast_full,
    distributed_request,
    plan_reshard,
    send_all,
)

torch.set_num_threads(1)
TOL = 1e-5
PROMPTS = [[2, 10, 11, 12, 13, 3], [2, 20, 21, 3], [2, 30, 31, 32, 33, 34, 35, 36, 3]]
ENGINES = ("tp1", "tp2")


class Reference:
    """A tp=1 HF model holding the weights the servers should hold."""

    def __init__(self, model_path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.state = {name: t.detach().clone() for name, t in self.model.state_dict().items()}
        self.version = "default"

    def changed(self, names, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return {n: self.state[n] + scale * torch.randn(self.state[n].shape, generator=generator) for n in names}

    def set(self, new: dict[str, torch.Tensor], version: str) -> None:
        self.state.update({n: t.float() for n, t in new.items()})
        self.model.load_state_dict(self.state)
        self.version = version

    def logprobs(self) -> list[torch.Tensor]:
        out = []
        with torch.no_grad():
            for prompt in PROMPTS:
                logits = self.model(torch.tensor([prompt])).logits[0, :-1]
                out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0])
        return out


@pytest.fixture(scope="module")
def servers(tiny_model_path):
    common = dict(torch_threads=1, seed=0, max_batch_size=8)
    started = {
        "tp1": RolloutServerProcess(tiny_model_path, **common),
        "tp2": RolloutServerProcess(tiny_model_path, extra_args=("--tp", "2"), **common),
    }
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(s.start) for s in started.values()]:
                future.result()
        clients = {key: RolloutClient(s.url, max_retries=0) for key, s in started.items()}
        yield {key: (clients[key], 1 if key == "tp1" else 2) for key in ENGINES}
        for client in clients.values():
            client.close()
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return Reference(tiny_model_path)


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(8) as executor:
        yield executor


@pytest.fixture(scope="module")
def dist_group(servers, pool):
    trainer = TrainerGroup("megarl-dist-test", servers, n_senders=1)
    answers = trainer.form(pool)
    assert "ranks 2..3 of 4" in answers["tp2"]["message"], answers
    yield trainer
    trainer.close()


@pytest.fixture(scope="module")
def reshard_group(servers, pool):
    trainer = TrainerGroup("megarl-reshard-test", servers, n_senders=2)
    trainer.form(pool)
    yield trainer
    trainer.close()


def server_logprobs(client) -> list[torch.Tensor]:
    response = httpx.post(
        f"{client.base_url}/generate",
        timeout=60,
        json={
            "input_ids": PROMPTS,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0},
        },
    )
    assert response.status_code == 200, f"{client.base_url} does not serve: {response.text}"
    out = response.json()
    return [torch.tensor([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]) for o in out]


def assert_serves(servers, reference, tol=TOL):
    expected = reference.logprobs()
    for key, (client, _) in servers.items():
        for got, want in zip(server_logprobs(client), expected, strict=True):
            torch.testing.assert_close(got, want, atol=tol, rtol=0, msg=lambda m: f"{key}: {m}")
        assert client.get_weight_version() == reference.version, key


def assert_unchanged(servers, before: dict, version: str):
    for key, (client, _) in servers.items():
        for got, want in zip(server_logprobs(client), before[key], strict=True):
            assert torch.equal(got, want), f"{key}: weights changed"
        assert client.get_weight_version() == version, key


def snapshot(servers) -> dict:
    return {key: server_logprobs(client) for key, (client, _) in servers.items()}


def moved(before: dict, reference) -> float:
    return max((a - b).abs().max().item() for a, b in zip(before["tp1"], reference.logprobs()))


def distributed(servers, pool, trainer, named, load_format, version, defer=True, send=True):
    """Every engine posts the update, the trainer broadcasts; returns {engine: future}."""
    names, dtypes, shapes = distributed_request(named)
    futures = {
        key: pool.submit(
            client.update_weights_from_distributed,
            names,
            dtypes,
            shapes,
            trainer.name,
            load_format=load_format,
            weight_version=version,
            defer=defer,
        )
        for key, (client, _) in servers.items()
    }
    if send:
        broadcast_full(trainer.senders[0], named, load_format)
    return futures


def commit(servers, version: str) -> None:
    for client, _ in servers.values():
        assert client.commit_weight_update(version)["success"]


def layouts(servers) -> dict:
    return {
        key: httpx.get(f"{client.base_url}/get_parallelism_config", timeout=10).json()
        for key, (client, _) in servers.items()
    }


def reshard(servers, pool, trainer, new, version, wide=(), senders=None):
    """Both engines post their messages, both senders (or `senders`) send; returns {engine: future}."""
    sends, bodies = plan_reshard(layouts(servers), trainer.offsets, new, wide=wide)
    futures = {
        key: pool.submit(client.update_weights_from_reshard, trainer.name, bodies[key], weight_version=version)
        for key, (client, _) in servers.items()
    }
    for sent in [pool.submit(send_all, trainer.senders[s], sends[s]) for s in (senders or range(2))]:
        sent.result()
    return futures


# ---- (a) distributed, deferred then committed ---------------------------------------------------------
@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_distributed_deferred_then_committed_matches_hf(servers, pool, reference, dist_group, load_format):
    before, version = snapshot(servers), f"dist-{load_format}"
    new = reference.changed([n for n in reference.state if "layers.1" in n or "lm_head" in n], seed=len(version))
    named = sorted(new.items())
    named[0] = (named[0][0], named[0][1].bfloat16())  # mixed dtypes in one bucket; the engine casts
    buckets = [named[: len(named) // 2], named[len(named) // 2 :]]
    for bucket in buckets:  # two buckets of one version, staged
        for key, future in distributed(servers, pool, dist_group, bucket, load_format, version).items():
            assert "staged" in future.result()["message"], key
    assert_unchanged(servers, before, reference.version)  # nothing written before the commit
    commit(servers, version)
    reference.set(dict(named), version)
    assert moved(before, reference) > 1e-3
    assert_serves(servers, reference)


def test_distributed_without_defer_writes_at_once(servers, pool, reference, dist_group):
    new = reference.changed(["model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"], seed=5)
    for future in distributed(
        servers, pool, dist_group, list(new.items()), "flattened_bucket", "direct", defer=False
    ).values():
        assert "updated 2 tensors" in future.result()["message"]
    reference.set(new, "direct")
    assert_serves(servers, reference)


# ---- (b) reshard: each rank its own pieces, from two senders --------------------------------------------
def test_reshard_full_model_from_two_senders_refills_resumed_weights(servers, pool, reference, reshard_group):
    """Weights released and resumed first: a parameter counts as refilled only because the union of
    its two boxes covers its shard, so generation working afterwards checks that bookkeeping too."""
    for client, _ in servers.values():
        client.release_memory_occupation(["weights"])
        client.resume_memory_occupation(["weights"])
    new = reference.changed(list(reference.state), seed=7)
    sends, bodies = plan_reshard(layouts(servers), reshard_group.offsets, new)
    halves = {key: [[m for m in messages if m["src"] == 0] for messages in ranks] for key, ranks in bodies.items()}
    futures = [
        pool.submit(client.update_weights_from_reshard, reshard_group.name, halves[key], weight_version="half")
        for key, (client, _) in servers.items()
    ]
    send_all(reshard_group.senders[0], sends[0])
    for future in futures:
        future.result()
    commit(servers, "half")  # every parameter got one of its two boxes: none counts as refilled
    for client, _ in servers.values():
        response = httpx.post(f"{client.base_url}/generate", json={"input_ids": [2, 5]}, timeout=10)
        assert response.status_code == 503 and "45 parameters were not refilled" in response.text, response.text
    wide = ("model.layers.0.self_attn.k_proj.weight",)  # sent as float64
    for key, future in reshard(servers, pool, reshard_group, new, "reshard-1", wide=wide).items():
        assert "staged" in future.result()["message"], key
    commit(servers, "reshard-1")
    before = {"tp1": reference.logprobs()}
    reference.set(new, "reshard-1")
    assert moved(before, reference) > 1e-3
    assert_serves(servers, reference)


# ---- (d) the stage: wrong version, stale version, abort -------------------------------------------------
def _defer_tensor(servers, buffer, named, version):
    """The bridge's tensor sender: one shared-memory buffer, reused for every bucket."""
    for client, tp in servers.values():  # one payload per rank: each is unpickled once
        payloads = [serialize_flattened_bucket(named, out=buffer) for _ in range(tp)]
        body = {
            "serialized_named_tensors": payloads,
            "load_format": "flattened_bucket",
            "weight_version": version,
            "defer": True,
        }
        reply = httpx.post(f"{client.base_url}/update_weights_from_tensor", json=body, timeout=60).json()
        assert reply["success"] and "staged" in reply["message"], reply


def test_commit_of_another_version_fails_and_discards_abort_discards(servers, reference):
    before, version = snapshot(servers), reference.version
    buffer = torch.empty(1 << 16, dtype=torch.uint8).share_memory_()
    name = "model.layers.1.self_attn.o_proj.weight"
    _defer_tensor(servers, buffer, list(reference.changed([name], seed=11).items()), "v-a")
    for client, _ in servers.values():
        with pytest.raises(RolloutRequestError, match="holds weight_version 'v-a', not 'v-b'"):
            client.commit_weight_update("v-b")
        with pytest.raises(RolloutRequestError, match="nothing is staged for weight_version 'v-a'"):
            client.commit_weight_update("v-a")  # the failed commit discarded the stage
    _defer_tensor(servers, buffer, list(reference.changed([name], seed=12).items()), "v-c")
    for client, _ in servers.values():
        assert "discarded 1 staged pieces" in client.abort_weight_update()["message"]
        assert client.abort_weight_update()["message"] == "nothing was staged"
        with pytest.raises(RolloutRequestError, match="nothing is staged"):
            client.commit_weight_update("v-c")
    assert_unchanged(servers, before, version)


def test_staged_tensor_values_are_copies_and_a_new_version_replaces_a_stale_stage(servers, reference):
    buffer = torch.empty(1 << 16, dtype=torch.uint8).share_memory_()
    stale = reference.changed(["model.layers.0.mlp.gate.weight"], seed=13)
    _defer_tensor(servers, buffer, list(stale.items()), "stale")
    new = reference.changed(["model.layers.1.mlp.experts.2.up_proj.weight", "model.norm.weight"], seed=14)
    _defer_tensor(servers, buffer, list(new.items()), "fresh")  # the stale stage is discarded
    buffer.fill_(0)  # the sender reuses its buffer: the staged values must not change
    commit(servers, "fresh")
    reference.set(new, "fresh")
    assert_serves(servers, reference)


# ---- (e) refusals name the tensor, after taking its bytes -----------------------------------------------
def test_distributed_unknown_name_is_refused_after_receiving_and_the_group_stays_usable(
    servers, pool, reference, dist_group
):
    before = snapshot(servers)
    named = [("model.norm.weight", torch.ones(64)), ("no.such.weight", torch.ones(3))]
    futures = distributed(servers, pool, dist_group, named, None, "bad")  # the broadcasts return
    for future in futures.values():
        with pytest.raises(RolloutRequestError, match="nothing was written: 'no.such.weight' is not a parameter"):
            future.result()
    assert_unchanged(servers, before, reference.version)
    new = reference.changed(["model.layers.1.self_attn.v_proj.weight"], seed=15)
    for future in distributed(servers, pool, dist_group, list(new.items()), None, "after-bad").values():
        future.result()
    commit(servers, "after-bad")
    reference.set(new, "after-bad")
    assert_serves(servers, reference)


def test_reshard_box_outside_the_shard_and_unknown_name_are_refused_after_receiving(
    servers, pool, reference, reshard_group
):
    before, client = snapshot(servers), servers["tp2"][0]
    q = "model.layers.0.self_attn.q_proj.weight"  # tp=2: each rank holds 32 of its 64 rows
    data = torch.zeros(40 * 64 * 4 + 12, dtype=torch.uint8)
    entries = [
        {"name": q, "dtype": "float32", "box": [[0, 40], [0, 64]], "offset": 0},
        {"name": "no.such.weight", "dtype": "float32", "box": [[0, 3]], "offset": 40 * 64 * 4},
    ]
    dst = reshard_group.offsets["tp2"] + 1
    ranks = [[], [{"src": 0, "tag": 7, "nbytes": data.numel(), "entries": entries}]]
    future = pool.submit(client.update_weights_from_reshard, reshard_group.name, ranks, weight_version="r-bad")
    send_all(reshard_group.senders[0], [(dst, 7, data)])  # returns: the engine took the bytes
    with pytest.raises(RolloutRequestError) as refused:
        future.result()
    message = str(refused.value)
    assert (
        f"{q!r} (message 0 from group rank 0, tag 7): box [[0, 40], [0, 64]] is outside this rank's local "
        "shard of shape [32, 64]"
        in message
        and "'no.such.weight'" in message
    ), message
    assert "nothing was written" in message and "discarded" in message
    with pytest.raises(RolloutRequestError, match="already discarded"):  # the rest of r-bad is refused too
        client.update_weights_from_reshard(reshard_group.name, [[], []], weight_version="r-bad")
    client.abort_weight_update()
    assert_unchanged(servers, before, reference.version)


# ---- (c) a sender that dies or closes its group mid-update ----------------------------------------------
_DOOMED_SENDER = """
import sys, torch
torch.set_num_threads(1)
from megarl.wire.update_group import join_update_group
group = join_update_group("127.0.0.1", int(sys.argv[1]), 1, int(sys.argv[2]), sys.argv[3], timeout_s=60)
print("joined", flush=True)
sys.stdin.read()  # holds the group open until the test kills this process
"""


def test_reshard_sender_killed_mid_update_fails_naming_the_group_and_writes_nothing(servers, pool, reference):
    before, version = snapshot(servers), reference.version
    trainer = TrainerGroup("megarl-reshard-doomed", servers, n_senders=2)
    doomed = subprocess.Popen(
        [sys.executable, "-c", _DOOMED_SENDER, str(trainer.store.port), str(trainer.world_size), trainer.name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        trainer.form(pool, extra_senders=(1,))
        assert doomed.stdout.readline() == b"joined\n"
        trainer.senders.append(None)  # rank 1 lives in the doomed process
        new = reference.changed(["model.layers.0.self_attn.o_proj.weight", "lm_head.weight"], seed=21)
        futures = reshard(servers, pool, trainer, new, "doomed", senders=[0])  # sender 0's half arrives
        doomed.kill()  # sender 1 dies before sending its half
        for key, future in futures.items():
            with pytest.raises(RolloutRequestError) as failed:
                future.result(timeout=TRAINER_TIMEOUT_S)
            assert "receiving over weight update group 'megarl-reshard-doomed' failed" in str(failed.value), key
            assert "the group was destroyed on every rank" in str(failed.value)
    finally:
        doomed.kill()
        doomed.wait()
        trainer.senders = [g for g in trainer.senders if g is not None]
        trainer.close()
    assert_unchanged(servers, before, version)
    for client, _ in servers.values():
        with pytest.raises(RolloutRequestError, match="'megarl-reshard-doomed' does not exist"):
            client.destroy_weights_update_group("megarl-reshard-doomed")
        with pytest.raises(RolloutRequestError, match="staged update for weight_version 'doomed' was discarded"):
            client.commit_weight_update("doomed")
    again = TrainerGroup("megarl-reshard-doomed", servers, n_senders=2)  # the same name: it was destroyed
    try:
        again.form(pool)
        new = reference.changed(["model.layers.0.self_attn.o_proj.weight", "lm_head.weight"], seed=22)
        for future in reshard(servers, pool, again, new, "after-doomed").values():
            future.result()
        commit(servers, "after-doomed")
        reference.set(new, "after-doomed")
        assert_serves(servers, reference)
    finally:
        again.close()


def test_distributed_sender_closing_its_group_mid_update_discards_the_stage(servers, pool, reference):
    before, version = snapshot(servers), reference.version
    trainer = TrainerGroup("megarl-dist-closing", servers)
    trainer.form(pool)
    named = list(reference.changed(["model.layers.1.mlp.gate.weight", "model.norm.weight"], seed=31).items())
    for future in distributed(servers, pool, trainer, named[:1], None, "closing").values():
        future.result()  # bucket 1 staged
    futures = distributed(servers, pool, trainer, named, None, "closing", send=False)
    trainer.senders[0].broadcast(named[0][1], src=0).wait()  # bucket 2: the first of its two tensors
    trainer.close()
    for key, future in futures.items():
        with pytest.raises(RolloutRequestError, match="group 'megarl-dist-closing' failed"):
            future.result(timeout=TRAINER_TIMEOUT_S)
        with pytest.raises(RolloutRequestError, match="nothing is staged|discarded"):
            servers[key][0].commit_weight_update("closing")
    assert_unchanged(servers, before, version)


def test_malformed_distributed_request_closes_the_group_so_the_sender_is_not_left_waiting(servers, pool, reference):
    trainer = TrainerGroup("megarl-dist-malformed", servers)
    trainer.form(pool)
    futures = {
        key: pool.submit(
            client.update_weights_from_distributed,
            ["model.norm.weight"],
            ["floaty"],
            [[64]],
            trainer.name,
            load_format=None,
            weight_version="malformed",
        )
        for key, (client, _) in servers.items()
    }
    sent = pool.submit(lambda: trainer.senders[0].broadcast(torch.ones(64), src=0).wait())
    for future in futures.values():
        with pytest.raises(RolloutRequestError, match="does not say what the sender broadcasts.*'floaty'"):
            future.result(timeout=TRAINER_TIMEOUT_S)
    done, _ = concurrent.futures.wait([sent], timeout=10)  # fails at once (or had finished): never blocked
    assert done, "the sender is still blocked in its broadcast"
    trainer.close()
    for client, _ in servers.values():
        assert client.get_weight_version() == reference.version
