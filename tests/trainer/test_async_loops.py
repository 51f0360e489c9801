"""trainer.mode one_step_off and fully_async on one disaggregated runtime (trainer/sources.py):
staleness, parity after every sync, per-token versions, routing replay, failover, NaN guards,
checkpoints. The producer alone, against scripted engines: test_async_producer.py."""

from __future__ import annotations

import collections
import io
import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest

from megarl.config.loader import load_config
from megarl.config.validate import validate
from megarl.trainer.finite import NonFiniteError
from megarl.trainer.parity import engine_versions
from tests._failures import run_while_killing
from tests._parity import MEAN_BOUND, assert_served_by_the_trainers_weights

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory):
    """One runtime: one_step_off for 4 steps (checkpoints at 2 and 4), then fully_async resumed
    from one_step_off's step-2 checkpoint for steps 3 and 4, then a one_step_off trainer whose
    rollout source hands it one NaN engine log-prob with the parity check off (the error it
    stopped with, and the version the engines serve after it)."""
    from megarl.trainer import checkpoints
    from megarl.trainer.loop import Trainer
    from megarl.trainer.metrics import MetricsLogger
    from megarl.trainer.runtime import start_runtime

    out = tmp_path_factory.mktemp("async")
    cfg = validate(
        load_config(
            ROOT / "configs/disaggregated.yaml",
            [
                f"trainer.output_dir={out}",
                "trainer.total_steps=4",
                "trainer.val_every=0",
                "data.num_train=64",
                "rollout.tp=1",
                "rollout.n=4",
                "actor.ppo_mini_batch_size=32",
                "actor.micro_batch_size=16",
                "trainer.loggers=[console,jsonl]",
                "trainer.export_hf=false",
                "trainer.save_every=2",
                "trainer.mode=one_step_off",
                "actor.moe.routing_replay=true",  # every mode replays the rollout's experts
            ],
        )
    )
    with start_runtime(cfg) as rt:
        one = MetricsLogger(None, 4, stream=io.StringIO(), jsonl_path=out / "one.jsonl")
        trainer = Trainer(rt, one)
        trainer.source = one_rows = _Counting(trainer.source)
        _, killed = run_while_killing(rt.fleet, 0, trainer.fit)  # the engine dies holding step 1's requests
        one.close()
        state2 = json.loads((rt.run_dir / "checkpoints/step_000002/trainer_state.json").read_text())
        rt.cfg.trainer.mode, rt.cfg.trainer.save_every = "fully_async", 0
        point = checkpoints.resume_point(rt.run_dir, str(rt.run_dir / "checkpoints/step_000002"))
        full = MetricsLogger(None, 4, stream=io.StringIO(), jsonl_path=out / "full.jsonl", resume_step=2)
        trainer = Trainer(rt, full, resume=point)
        trainer.source = full_rows = _Counting(trainer.source, kill_on_start=rt.fleet)  # the producer's
        trainer.fit()  # first requests (its 2 steps take ~1 s: too quick to catch mid-answer)
        full.close()
        rt.cfg.trainer.mode, rt.cfg.bridge.check_parity = "one_step_off", False  # the guard, not parity
        poisoned = Trainer(rt, MetricsLogger(None, 4, stream=io.StringIO()))
        poisoned.weight_version = 4  # the actor and the engines hold version 4
        poisoned.source = _NaNLogProb(poisoned.source)
        with pytest.raises(NonFiniteError) as nan_error:
            poisoned.fit()
        served = engine_versions(rt.fleet)
        rt.cfg.bridge.check_parity, caught = True, {}
        for transport in ("reshard", "distributed", "disk", "tensor"):
            for mode in ("sync", "one_step_off", "fully_async"):
                caught[mode, transport] = _faulty_sync_caught(rt, mode, transport, 5 + 2 * len(caught))
        for kind, rank in (("loss", 1), ("grad", 0)):  # last: a NaN gradient is applied (policy: stop)
            caught[kind] = _nan_update_caught(rt, kind, rank, 100 + len(caught))
    read = lambda name: [json.loads(x) for x in (out / name).read_text().splitlines()]  # noqa: E731
    rows = {
        "one": one_rows.seen,
        "full": full_rows.seen,
        "killed": [killed, full_rows.killed],
        "spans": full_rows.spans,
        "routed": [one_rows.routed, full_rows.routed],
    }
    return read("one.jsonl"), read("full.jsonl"), state2, trainer, (str(nan_error.value), served), rows, caught


def _nan_update_caught(rt, kind: str, rank: int, version: int) -> str:
    """A sync-loop step whose update has a NaN `kind` ("loss" or "grad") on `rank`: its error."""
    from megarl.trainer.loop import Trainer
    from megarl.trainer.metrics import MetricsLogger

    rt.cfg.trainer.mode, rt.cfg.bridge.transport = "sync", "reshard"
    trainer = Trainer(rt, MetricsLogger(None, 3, stream=io.StringIO()))
    trainer.weight_version = trainer.actor_version = version - 1
    trainer.sync_weights()
    rt.actor.inject_update_fault(kind, rank)
    with pytest.raises(NonFiniteError) as error:
        trainer.fit()
    return str(error.value)


def _faulty_sync_caught(rt, mode: str, transport: str, version: int) -> str:
    """From engines holding the actor's weights as `version - 1`: a `mode` trainer whose step-1
    sync (over `transport`) sends the word embeddings + 0.05; the error its next step raises."""
    from megarl.trainer.loop import Trainer
    from megarl.trainer.metrics import MetricsLogger
    from megarl.trainer.parity import ParityError

    rt.cfg.trainer.mode, rt.cfg.bridge.transport, rt.cfg.trainer.total_steps = mode, transport, 3
    trainer = Trainer(rt, MetricsLogger(None, 3, stream=io.StringIO()))
    trainer.weight_version = trainer.actor_version = version - 1
    trainer.sync_weights()  # the engines hold the actor's weights (a failed trial left them wrong)
    rt.actor.inject_sync_fault("word_embeddings", 0.05)
    with pytest.raises(ParityError) as error:
        trainer.fit()
    return str(error.value)


class _Counting:
    """A rollout source that records, per step, how many rows of each prompt it trained."""

    def __init__(self, inner, kill_on_start=None):
        """`kill_on_start`: a fleet whose engine 0 is SIGKILLed as the source starts generating.
        `spans[step]`: each row's newest minus oldest token version, from the rows as generated."""
        self.inner, self.off_policy, self.seen, self.spans, self.routed = inner, inner.off_policy, {}, {}, {}
        self.fleet, self.killed = kill_on_start, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self):
        pid = self.fleet.server_pids()[0][0] if self.fleet is not None else None
        self.inner.start()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            self.killed = pid

    def rows(self, step, timing):
        rows, stats = self.inner.rows(step, timing)
        self.seen[step] = collections.Counter(rows["uid"])  # a prompt's id in its epoch
        versions, mask = rows["rollout_versions"], rows["response_mask"] > 0
        self.spans[step] = [int(v[m].max() - v[m].min()) if m.any() else 0 for v, m in zip(versions, mask)]
        fed = rows["prompt_lengths"] + mask.sum(1) - 1  # tokens the engine fed: each has its experts
        recorded = (rows["routed_experts"] >= 0).all(-1).sum(1)
        self.routed[step] = bool((recorded == fed).all())
        return rows, stats


class _NaNLogProb:
    """A rollout source whose rows carry one NaN engine log-prob (row 3's first response token)."""

    def __init__(self, inner):
        self.inner, self.off_policy = inner, inner.off_policy

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def rows(self, step, timing):
        rows, stats = self.inner.rows(step, timing)
        rows["rollout_log_probs"][3, 0] = float("nan")
        return rows, stats


def test_a_nan_engine_log_prob_stops_the_step_before_the_weights_move(async_runs):
    message, served = async_runs[4]
    assert message.startswith("step 1, weight version 4: the rollout engine's log-probs (rollout_log_probs, ")
    # the row's index is after the data-parallel balancing, which depends on the lengths sampled
    assert re.search(
        r"non-finite at 1 response tokens in 1 rows; first: row \d+ \(nan\), served with weight_version '4'$", message
    )
    assert served and all(line.endswith(": '4'") for line in served), served  # no sync after the refused step


def test_one_step_off_trains_one_version_behind(async_runs):
    """Every batch after the first was sampled one version behind, except the one the killed
    engine regenerated (test below): the engine restarted with the actor's newest weights, labelled
    so, and its rows are the trainer's version (truthful labels, parity checked on them)."""
    steps = async_runs[0]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    # step 1's rows come from the weights it trains: parity holds exactly as in the sync loop
    assert steps[0]["async/staleness_max"] == 0
    assert_served_by_the_trainers_weights(steps[0])
    behind = [m for m in steps[1:] if m["async/staleness_max"] == 1]
    assert len(behind) >= 2, [m["async/staleness_max"] for m in steps]
    for m in steps[1:]:
        if m["async/staleness_max"] == 0:  # regenerated by the restarted engine with these weights
            assert_served_by_the_trainers_weights(m)
    for m in behind:  # sampled by the version before the one it trains
        assert m["async/staleness_mean"] == 1
        assert m["rollout/logprob_diff_max"] > 1e-4  # off-policy by one update (logged, not an error)
        assert m["rollout/logprob_diff_mean"] > MEAN_BOUND  # every row: what a stale sync looks like
        assert m["perf/gen_s"] > 0 and m["actor/grad_norm"] > 0 or m["adv/max"] == 0 == m["adv/min"]
    for m in steps:
        bad = {k: v for k, v in m.items() if not np.isfinite(v)}
        assert not bad, bad
        # after every sync, every engine re-scored rows of the step with the version the trainer
        # holds; but in the step whose sync found the engine being restarted (it gets the weights
        # before it serves, and the next step's probe checks it)
        assert m["parity/engines"] + m["parity/engines_unreachable"] == 1
        if m["parity/engines"] == 0:
            assert m["rollout/engine_restarts"] == 1
            continue
        assert m["parity/rows"] == 8
        assert_served_by_the_trainers_weights(m, "parity/")
    # decoupled PPO with token-level TIS by default (actor.rollout_is.level: auto): every weight is
    # 1 where the rows are the trainer's version (step 1), not where they are a version behind (the
    # weights' mean stays ~1 there: that is what importance weights do under the behaviour policy)
    assert steps[0]["rollout_is/spread"] < MEAN_BOUND
    for m in behind:
        assert m["rollout_is/spread"] > 100 * MEAN_BOUND, m["rollout_is/spread"]
        assert m["rollout_is/mean"] == pytest.approx(1.0, abs=0.05)


def test_the_loss_sees_each_tokens_behaviour_version_through_the_data_parallel_split(async_runs):
    """Each row carries, per response token, the version of the weights that produced it (the
    engine's record, through the client and the batch); the loss's rollout/version_span_mean is
    computed on the trainer's ranks from what reached them after balancing and the data-parallel
    split, and equals the span of the rows as generated (exactly: equal micro-batches). Rows that
    span versions: test_a_row_spanning_versions_reaches_the_loss_with_each_tokens_version."""
    full, spans = async_runs[1], async_runs[5]["spans"]
    assert sorted(spans) == [3, 4]
    for m in full:
        expected = sum(spans[m["step"]]) / len(spans[m["step"]])
        assert m["rollout/version_span_mean"] == pytest.approx(expected, abs=1e-12), (m["step"], expected)


def test_routing_replay_in_both_async_modes_and_the_probe_replays_the_engines_experts(async_runs):
    """The fixture's runs replay the rollout's MoE experts: every row of every step reached the
    trainer with the experts of every token the engine fed (a resumed row too). The probe after a
    sync compares the engines' scores, routed by the version they hold now, with the trainer's
    log-probs replaying those same experts (the step's old log-probs replay the rollout's, which the
    new version need not choose: compared with those, the probe failed at 1.8e-2)."""
    one, full, rows = async_runs[0], async_runs[1], async_runs[5]
    assert rows["routed"] == [{1: True, 2: True, 3: True, 4: True}, {3: True, 4: True}]
    for m in one + full:
        if m["parity/engines"]:
            assert m["parity/diff_max"] <= 1e-4, (m["step"], m["parity/diff_max"])


def test_an_engine_killed_mid_generation_loses_no_row_in_either_async_mode(async_runs):
    """The only engine is SIGKILLed while it holds requests (one_step_off: step 1's batch on the rollout
    thread; fully_async: as the producer sends its first requests after the resume): restarted, given
    the actor's weights, the failed requests are sent again, and every step trains each of its
    prompts' n rows exactly once, each prompt in one step only."""
    one, full, rows = async_runs[0], async_runs[1], async_runs[5]
    assert rows["killed"][1] not in (rows["killed"][0], None)  # the restarted engine died too
    for steps, seen in ((one, rows["one"]), (full, rows["full"])):
        assert sum(m["rollout/engine_restarts"] for m in steps) == 1
        prompts = [p for counts in seen.values() for p in counts]
        assert len(prompts) == len(set(prompts)) == 16 * len(seen)  # data.train_batch_size 16
        assert all(n == 4 for counts in seen.values() for n in counts.values())  # rollout.n each
    # the producer's requests failed and were sent again (one_step_off's kill may land on the parity
    # probe's requests instead of a rollout's: the sync then finds the engine dead)
    assert sum(m["async/resent"] for m in full) >= 1 and sum(m["rollout/retries"] for m in full) >= 1


def test_a_sync_corrupted_in_transit_is_caught_in_every_mode_over_every_transport(async_runs):
    """One tensor (the word embeddings, + 0.05) is wrong in what the bridge sends at step 1's sync;
    the trainer keeps its own. The next step refuses: sync loop, its rows (sampled by the wrong
    weights); one_step_off and fully_async, the engines' re-scoring of probe rows (their rows are
    from the version before)."""
    caught = {k: v for k, v in async_runs[6].items() if isinstance(k, tuple)}
    assert len(caught) == 12
    for (mode, transport), message in caught.items():
        assert message.startswith("step 2"), (mode, transport, message)
        if mode != "sync":
            assert "Probe rows" in message, (mode, transport, message)


def test_a_nan_loss_or_gradient_on_a_rank_stops_the_step_with_one_line_naming_it(async_runs):
    caught = async_runs[6]
    end = "(actor update); the update is not synced to the engines; the last checkpoint is the way back"
    # the rank whose loss went NaN is named, not the NaN gradient norms it spread to every rank
    assert caught["loss"] == f"step 1, weight version 111: actor/pg_loss is nan on rank 1 {end}"
    assert caught["grad"] == f"step 1, weight version 112: actor/grad_norm is nan on rank 0 {end}"


def test_one_step_off_checkpoint_regenerates_the_batch_in_flight(async_runs):
    state = async_runs[2]
    # the batch generated ahead for step 3 is not saved: its prompts (batch 2, 0-based) come again
    assert state["step"] == 2 and state["weight_version"] == 2 and state["data_cursor"] == 2


def test_fully_async_resumed_from_a_checkpoint_keeps_the_staleness_bound(async_runs):
    steps, trainer = async_runs[1], async_runs[3]
    assert [m["step"] for m in steps] == [3, 4]
    assert trainer.start_step == 2 and trainer.weight_version == 4 and trainer.data_cursor == 4
    for m in steps:
        assert m["async/group_staleness_max"] <= 1 and m["async/staleness_max"] <= 1  # max_staleness=1
        assert 0 <= m["async/partial_frac"] <= 1
        assert m["parity/engines"] == 1
        assert_served_by_the_trainers_weights(m, "parity/")
    # the first batch after the resume was sent under the checkpoint's weights: parity checked
    assert steps[0]["async/staleness_max"] == 0
    assert_served_by_the_trainers_weights(steps[0])
