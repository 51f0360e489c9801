"""fully_async's rollout producer (trainer/async_rollout.py) against scripted engines: admission
and the staleness bound, the last step, aborted answers continued, rows that span versions as the
loss gets them, a failed recovery reaching take(); and what the async modes refuse. No Ray, no
ranks: the loops themselves run in test_async_loops.py."""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megarl.config.loader import ConfigError, load_config
from megarl.config.validate import validate
from megarl.data.batch import Batch
from megarl.rollout.client.client import GenerateOutput
from megarl.rollout.client.manager import SamplingSpec

ROOT = Path(__file__).resolve().parents[2]


def test_async_modes_refuse_what_they_cannot_run():
    base = ROOT / "configs/disaggregated.yaml"
    with pytest.raises(ConfigError, match="trainer.mode"):
        validate(load_config(ROOT / "configs/quickstart.yaml", ["trainer.mode=one_step_off"]))
    for override, key in [
        ("trainer.deterministic=true", "trainer.deterministic"),
        ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.enable"),
        ("trainer.max_staleness=-1", "trainer.max_staleness"),
        ("rollout.agent_loop=tool", "rollout.agent_loop"),
    ]:
        with pytest.raises(ConfigError, match=key):
            validate(load_config(base, ["trainer.mode=fully_async", override]))
    validate(load_config(base, ["trainer.mode=one_step_off", "trainer.deterministic=true"]))


# ---- the producer against a scripted engine ---------------------------------------------------
class _ScriptedClient:
    """agenerate answers when the test releases that prompt (by its first token), tagged with the
    version the engine holds at that moment."""

    retries = 0

    def __init__(self):
        self.release: dict[int, threading.Event] = {}
        self.version = "default"
        self.sent: list[int] = []

    async def agenerate(self, ids, params, return_logprob=False):
        key = ids[0][0]
        self.sent.append(key)
        event = self.release.setdefault(key, threading.Event())
        while not event.is_set():
            await asyncio.sleep(0.001)
        return [
            GenerateOutput(
                output_ids=[5, 6],
                text="x",
                finish_reason={"type": "stop"},
                meta_info={"weight_version": self.version},
                output_logprobs=[-1.0, -2.0],
            )
            for _ in range(params["n"])
        ]

    def close(self):
        pass


class _Prompts:
    """Batch k holds prompts [100k, 7] and [100k + 1, 7]."""

    def batch_at(self, k):
        ids = np.empty(2, dtype=object)
        ids[:] = [[100 * k + i, 7] for i in range(2)]
        return Batch({}, {"raw_prompt_ids": ids, "uid": np.array([f"p{100 * k + i}" for i in range(2)], dtype=object)})


def _producer(client, max_staleness, steps=None):
    from megarl.trainer.async_rollout import RolloutProducer

    fleet = SimpleNamespace(
        router_url="http://r",
        live_urls=lambda: ["http://r"],
        engine_urls=[],
        api_key=None,
        abort_all_requests=lambda: None,
    )
    return RolloutProducer(
        SimpleNamespace(fleet=fleet),
        _Prompts(),
        0,
        SamplingSpec(n=2),
        groups_per_step=2,
        max_staleness=max_staleness,
        version=0,
        steps=steps,
        make_client=lambda url: client,
    )


def _wait(cond, what):
    for _ in range(5000):
        if cond():
            return
        threading.Event().wait(0.001)
    raise AssertionError(what)


def test_a_row_spanning_versions_reaches_the_loss_with_each_tokens_version_and_behaviour_log_prob():
    """The producer's rows of answers interrupted by a weight update (tokens of versions 0 then 1,
    behaviour log-probs -1 and -2), as the actor's loss gets them: the version span is 1 and the
    token-level truncated importance weights are exp(old - behaviour) per token."""
    from megarl.engine.megatron.actor import ActorLossSpec, actor_loss

    p = _producer(_AbortingClient(), max_staleness=1, steps=1)
    try:
        rows, _ = p.take(0, {})
    finally:
        p.stop()
    old = torch.tensor([[-1.5, -1.5]] * 4)
    mb = Batch(
        {
            "response_mask": rows["response_mask"],
            "rollout_log_probs": rows["rollout_log_probs"],
            "rollout_versions": rows["rollout_versions"],
            "old_log_probs": old,
            "advantages": torch.ones(4, 2),
        }
    )
    lp = old.clone().requires_grad_(True)
    _, _, metrics = actor_loss(ActorLossSpec(rollout_is_level="token"), lp, torch.zeros(4, 2), mb)
    assert metrics["rollout/version_span_mean"] == 1.0
    w = [min(math.exp(-1.5 - b), 2.0) for b in (-1.0, -2.0)]  # per token, against its own behaviour
    assert metrics["rollout_is/mean"] == pytest.approx(sum(w) / 2, rel=1e-6)


def test_producer_admits_max_staleness_plus_one_steps_and_drops_late_groups():
    client = _ScriptedClient()
    p = _producer(client, max_staleness=1)
    try:
        _wait(lambda: len(client.sent) == 4, "4 groups sent")  # (0 + 1 + 1) * 2 groups admitted
        threading.Event().wait(0.05)
        assert len(client.sent) == 4  # and no more until the trainer moves on
        for key in (0, 1):
            client.release[key].set()
        rows, stats = p.take(0, {})
        assert len(rows) == 4 and list(rows["uid"]) == ["p0", "p0", "p1", "p1"]
        assert torch.equal(rows["response_mask"], torch.ones(4, 2))
        p.set_version(1)
        client.version = "1"
        _wait(lambda: len(client.sent) == 6, "two more admitted at version 1")
        # group 100 (sent at v0) finishes now; at version 2 it would be 2 versions old: dropped
        for key in (100, 101, 200, 201):
            client.release[key].set()
        _wait(lambda: len(p._buffer) == 4, "all four finished")
        p.set_version(2)
        rows, stats = p.take(2, {})
        assert stats["async/dropped_stale"] == 2 and stats["async/group_staleness_max"] <= 1
        assert list(rows["uid"]) == ["p200", "p200", "p201", "p201"]
    finally:
        for e in client.release.values():
            e.set()
        p.stop()


def test_producer_sends_nothing_past_the_last_step():
    """Two steps of two groups: four are sent, however far admission would reach, and a dropped
    group is replaced."""
    client = _ScriptedClient()
    p = _producer(client, max_staleness=3, steps=2)  # admission alone would allow (0+3+1)*2 = 8
    try:
        _wait(lambda: len(client.sent) == 4, "4 groups sent")
        threading.Event().wait(0.05)
        assert len(client.sent) == 4
        for key in (0, 1, 100, 101):
            client.release[key].set()
        _wait(lambda: len(p._buffer) == 4, "all four finished")
        with p._cond:  # as if one group had come out stale: it frees one send
            p._buffer.pop()
            p._dropped += 1
            p._notify()
        _wait(lambda: len(client.sent) == 5, "the dropped group replaced")
        threading.Event().wait(0.05)
        assert len(client.sent) == 5
    finally:
        for e in client.release.values():
            e.set()
        p.stop()


def test_a_failure_of_the_fleets_recovery_reaches_take_instead_of_losing_the_prompt():
    """A request fails and looking for dead engines fails too (here the fleet has no recover):
    take() raises that error. Before, the request's task died with it unseen and take() waited
    forever for a group that would never come."""

    class _Failing:
        retries = 0

        async def agenerate(self, ids, params, return_logprob=False):
            raise ConnectionError("engine gone")

        def close(self):
            pass

    p = _producer(_Failing(), max_staleness=1)
    try:
        with pytest.raises(RuntimeError, match="fully_async rollout failed") as failed:
            p.take(0, {})  # raises within ~1 s (take looks at the error once a second)
        assert isinstance(failed.value.__cause__, AttributeError)  # SimpleNamespace has no recover
    finally:
        p.stop()


class _AbortingClient:
    """Every first answer is interrupted after one token (finish_reason abort, as an engine that
    pauses for a weight update by aborting answers); the continuation (prompt + that token)
    finishes with one more token under the next version."""

    retries = 0

    def __init__(self, per_token_record: bool = True):
        """per_token_record False: answers carry only the version they ended under (SGLang)."""
        self.requests: list[tuple[list[int], dict]] = []
        self.record = per_token_record

    async def agenerate(self, ids, params, return_logprob=False, rids=None):
        params = params if isinstance(params, dict) else params[0]
        self.requests.append((list(ids[0]), dict(params)))
        if ids[0][-1] != 5:  # a fresh prompt: interrupted after token 5
            meta = {
                "weight_version": "default",
                **({"weight_versions": [{"version": "default", "start": 0, "end": 1}]} if self.record else {}),
            }
            out = GenerateOutput([5], "a", [-1.0], {"type": "abort"}, meta)
        else:  # the continuation, under version 1
            meta = {
                "weight_version": "1",
                **({"weight_versions": [{"version": "1", "start": 0, "end": 1}]} if self.record else {}),
            }
            out = GenerateOutput([6], "b", [-2.0], {"type": "stop"}, meta)
        return [out for _ in range(params["n"])]

    def close(self):
        pass


@pytest.mark.parametrize("per_token_record", [True, False], ids=["embedded", "sglang"])
def test_an_aborted_answer_is_continued_and_keeps_its_tokens_log_probs_and_versions(per_token_record):
    client = _AbortingClient(per_token_record)
    p = _producer(client, max_staleness=1, steps=1)
    try:
        rows, stats = p.take(0, {})
    finally:
        p.stop()
    assert stats["async/resumed"] == 4 and stats["async/partial_frac"] == 1.0  # 2 groups x n=2
    assert rows["responses"].tolist() == [[5, 6]] * 4
    assert rows["rollout_log_probs"].tolist() == [[-1.0, -2.0]] * 4
    assert list(rows["rollout_weight_version"]) == ["1"] * 4 and list(rows["finish_reason"]) == ["stop"] * 4
    # each token's version: the engine's record, or (SGLang) each segment's version at its boundary
    assert rows["rollout_versions"].tolist() == [[0, 1]] * 4
    continued = [(ids, params) for ids, params in client.requests if ids[-1] == 5]
    assert len(continued) == 4 and all(params["n"] == 1 for _, params in continued)
    assert all(params["max_new_tokens"] == SamplingSpec(n=2).max_new_tokens - 1 for _, params in continued)
