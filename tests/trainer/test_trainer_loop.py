"""The sync GRPO loop for a few steps, in-process: real Ray, Megatron ranks, embedded server."""

from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from megarl.config.loader import load_config
from megarl.config.validate import validate
from tests._failures import run_while_killing
from tests._parity import assert_served_by_the_trainers_weights
from tests.trainer.test_status import CLEAR, FakeTTY

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = [
    "reward/mean",
    "response/length_mean",
    "actor/kl",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/pg_loss",
    "rollout/logprob_diff_max",
    "perf/gen_s",
    "perf/reward_s",
    "perf/old_log_prob_s",
    "perf/ref_s",
    "perf/update_s",
    "perf/sync_s",
    "perf/step_s",
    "perf/release_s",
    "perf/resume_s",
    "rollout/retries",
    "rollout/engine_restarts",
    "perf/mfu/update",
    "perf/mfu/log_prob",
    "perf/mfu/ref",
    "perf/tflops_per_device/update",
]


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    from megarl.trainer.run import train

    out = tmp_path_factory.mktemp("loop")
    # TP=2 + sequence parallel here (the quickstart runs EP=2), KL loss on so the colocated
    # reference policy runs, validation on the last step; the actor offloads everything between
    # steps and the reference between calls (the sync parity below then covers the round trips);
    # a critic group (EP=2, its own layout) is built from the config next to the actor: PPO, GAE
    # over its values, with the KL to the reference both in the loss and, adaptively, in the reward
    # (the reference curve test keeps grpo's advantages; the score-only estimators are checked by
    # hand: docs/configuration.md). The old-log-prob pass runs here (actor.old_log_prob=
    # recompute); the reference curve and durability tests run auto's rollout log-probs. The
    # engine releases and resumes its memory around the update (auto keeps it on a CPU cluster).
    cfg = validate(
        load_config(
            ROOT / "configs/quickstart.yaml",
            [
                "actor.old_log_prob=recompute",
                "rollout.release_memory=true",
                f"trainer.output_dir={out}",
                "trainer.total_steps=3",
                "trainer.val_every=3",
                "trainer.val_before_train=true",
                "trainer.loggers=[console,jsonl,tensorboard,wandb,mlflow]",
                "data.num_train=64",
                "data.num_val=16",
                "actor.parallel.ep=1",
                "actor.parallel.tp=2",
                "actor.use_kl_loss=true",
                "actor.kl_loss_coef=0.01",
                "rollout.n=4",
                "actor.ppo_mini_batch_size=32",
                "actor.micro_batch_size=16",
                "actor.offload.params=true",
                "actor.offload.grads=true",
                "actor.offload.optimizer=true",
                "ref.offload=true",
                "critic.enabled=true",
                "critic.parallel.ep=2",
                "critic.ppo_mini_batch_size=32",
                "trainer.save_every=2",
                "algorithm.adv_estimator=gae",
                "algorithm.use_kl_in_reward=true",
                "algorithm.kl_ctrl.type=adaptive",
                "algorithm.kl_ctrl.horizon=100",
                "critic.optim.lr=1e-3",
            ],
        )
    )
    stream = FakeTTY()  # as on a terminal: with the status line (trainer/status.py)
    summary = train(cfg, stream=stream)
    run_dir = out / "quickstart"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines]
    assert steps[0]["step"] == 0  # trainer.val_before_train: the initial weights' validation
    return summary, steps[1:], run_dir, stream.getvalue()


def test_validation_before_training_is_logged_as_step_zero(three_steps):
    _, steps, run_dir, _ = three_steps
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and "val/reward_mean" in first and "reward/mean" not in first
    assert "val/reward_mean" in steps[-1] and "val/reward_mean" not in steps[0]  # then every val_every


def test_offloaded_actor_and_reference_and_a_critic_group(three_steps):
    _, steps, _, out = three_steps
    for m in steps:
        for key in ("perf/actor_offload_s", "perf/actor_onload_s", "perf/ref_offload_s", "perf/ref_onload_s"):
            assert m[key] > 0, (m["step"], key)
    assert "critic mesh" in out
    # PPO: the critic's values feed GAE and it trains every step; the adaptive KL coefficient moves
    for m in steps:
        assert m["perf/values_s"] > 0 and m["perf/critic_update_s"] > 0
        assert np.isfinite(m["critic/vf_loss"]) and m["critic/num_updates"] >= 1
    coefs = [m["kl_reward/coef"] for m in steps]
    assert coefs[0] == 0.001 and len(set(coefs)) == 3, coefs
    # trainer.save_every=2 over 3 steps: steps 2 and 3 (the last), each with the critic's own
    # checkpoint next to the actor's (the reference is rebuilt from model.path, never saved)
    _, _, run_dir, _ = three_steps
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert saved == ["step_000002", "step_000003"]
    for name in saved:
        parts = sorted(p.name for p in (run_dir / "checkpoints" / name).iterdir())
        assert parts == ["actor", "config.yaml", "critic", "trainer_state.json"], parts
        assert (run_dir / "checkpoints" / name / "critic" / "megarl_ckpt.json").is_file()


def test_three_steps_have_finite_metrics(three_steps):
    _, steps, _, _ = three_steps
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        missing = [k for k in REQUIRED if k not in m]
        assert not missing, f"step {m['step']} lacks {missing}"
        bad = {k: v for k, v in m.items() if not math.isfinite(v)}
        assert not bad, f"step {m['step']} has non-finite metrics {bad}"
        assert 0.0 <= m["reward/mean"] <= 1.0
        assert m["actor/grad_norm"] > 0  # random init: some groups have mixed rewards
    assert "val/reward_mean" in steps[-1]
    # per data_source (trainer/validation.py): one greedy sample, so mean@1 is the reward mean
    assert steps[-1]["val/megarl/digits/mean@1"] == steps[-1]["val/reward_mean"]
    assert 0.0 <= steps[-1]["val/megarl/digits/pass@1"] <= 1.0


def test_weight_sync_keeps_server_and_trainer_in_parity(three_steps):
    _, steps, _, _ = three_steps
    # steps 2 and 3 sample with weights the bridge pushed after steps 1 and 2
    for m in steps:
        assert_served_by_the_trainers_weights(m)


def test_console_progress_tensorboard_and_summary(three_steps):
    summary, _, run_dir, console = three_steps
    assert "step 3/3 | reward" in console
    assert re.search(r"\| mfu \d+\.\d% \|", console), console[-500:]
    assert "reward curve: first 3 steps mean" in console
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    assert summary["steps"] == 3


def test_the_wandb_and_mlflow_runs_hold_every_metric_of_metrics_jsonl(three_steps):
    """trainer.loggers lists wandb (offline, RUN_DIR/wandb) and mlflow (RUN_DIR/mlruns): each run
    has each metric of every step, step 0's validation included, at the trainer's step and with
    metrics.jsonl's value, and the run's config."""
    from mlflow.tracking import MlflowClient

    from megarl.trainer.trackers import mlflow_name
    from tests.trainer import _wandb_log

    _, _, run_dir, _ = three_steps
    expected = {}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        for key, value in record.items():
            if key != "step":
                expected.setdefault(key, []).append((record["step"], value))
    assert "val/megarl/digits/pass@1" in expected and "reward/mean" in expected
    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["mlflow"]["tracking_uri"] == (run_dir / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=state["mlflow"]["tracking_uri"])
    run_id = state["mlflow"]["run_id"]
    logged = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, mlflow_name(key))] for key in expected}
    assert logged == expected
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["actor.parallel.tp"] == "2"

    (path,) = run_dir.glob(f"wandb/offline-run-*/run-{state['wandb']['id']}.wandb")
    logged = {}
    for step, metrics in _wandb_log.history(path):
        for key, value in metrics.items():
            logged.setdefault(key, []).append((step, value))
    assert logged == expected
    assert _wandb_log.config(path)["actor"]["parallel"]["tp"] == 2


def test_a_terminal_shows_each_phase_and_the_log_gets_only_the_lines(three_steps):
    _, _, run_dir, console = three_steps
    phases = ["generate 64/64 rows", "reward", "engines release memory", "old log-probs", "reference log-probs"]
    phases += ["values", "advantages", "critic update", "actor update", "weight sync", "validation", "save checkpoint"]
    missing = [p for p in phases if f"\x1b[2m{p}" not in console]
    assert not missing, (missing, console[-2000:])
    log = (run_dir / "train.log").read_text()
    assert "\x1b" not in log and "\r" not in log
    for line in log.splitlines(keepends=True):  # each line the log got, on the terminal unchanged
        assert CLEAR + line in console, line


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory):
    """configs/disaggregated.yaml with two tp=1 engines behind sglang-router on their own pool, with
    ReMax's advantages (its greedy baseline rollout goes through the router too)."""
    from megarl.trainer.run import train

    out = tmp_path_factory.mktemp("disagg")
    cfg = validate(
        load_config(
            ROOT / "configs/disaggregated.yaml",
            [
                f"trainer.output_dir={out}",
                "trainer.total_steps=2",
                "trainer.val_every=0",
                "data.num_train=64",
                "rollout.tp=1",
                "rollout.num_servers=2",
                "rollout.n=4",
                "actor.ppo_mini_batch_size=32",
                "actor.micro_batch_size=16",
                "trainer.loggers=[console,jsonl]",
                "algorithm.adv_estimator=remax",
            ],
        )
    )
    stream = io.StringIO()
    train(cfg, stream=stream)
    lines = (out / "disaggregated" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines], stream.getvalue()


def test_disaggregated_engines_behind_the_router_stay_in_parity(disaggregated):
    steps, console = disaggregated
    assert "disaggregated; actor: 2 devices" in console and "rollout: 2 devices" in console
    assert "behind router http://" in console
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert_served_by_the_trainers_weights(m)  # both engines got every (reshard) sync
        assert m["rollout/retries"] == 0 and m["rollout/engine_restarts"] == 0
        assert "perf/release_s" not in m  # disaggregated engines keep their memory
        # reshard: each of the two tp=1 engines gets the whole model, point to point
        assert m["bridge/bytes"] == 2 * m["bridge/bytes_per_rollout_rank_max"] > 0
        # remax: one greedy response per prompt (16 prompts), scored; its time is its own stage
        assert m["perf/gen_baseline_s"] > 0 and 0.0 <= m["remax/baseline_mean"] <= 1.0
        assert 0.0 <= m["remax/beats_baseline_frac"] <= 1.0 and m["remax/greedy_length_mean"] > 0
        # remax: a step whose rewards all equal their greedy baselines (e.g. all 0 at random init)
        # has zero advantages, hence no policy gradient; any other step has one
        zero_adv = m["adv/max"] == 0 == m["adv/min"]
        assert (m["actor/grad_norm"] == 0) == zero_adv, (m["actor/grad_norm"], m["adv/max"], m["adv/min"])


def test_distributed_transport_through_the_loop_stays_in_parity(tmp_path):
    """SGLang's update groups from inside Ray workers: both EP ranks send their own experts."""
    from megarl.trainer.run import train

    cfg = validate(
        load_config(
            ROOT / "configs/disaggregated.yaml",
            [
                f"trainer.output_dir={tmp_path}",
                "trainer.total_steps=2",
                "trainer.val_every=0",
                "data.num_train=64",
                "rollout.n=4",
                "actor.ppo_mini_batch_size=32",
                "actor.micro_batch_size=16",
                "trainer.loggers=[console,jsonl]",
                "bridge.transport=distributed",
                "bridge.bucket_size_mb=0.05",
            ],
        )
    )
    train(cfg, stream=io.StringIO())
    steps = [json.loads(x) for x in (tmp_path / "disaggregated" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert_served_by_the_trainers_weights(m)
        assert m["bridge/buckets"] > 1  # 50 KiB buckets: the ticket lock takes turns


def test_engines_killed_mid_step_and_before_the_sync_the_run_goes_on_in_parity(tmp_path):
    """Two engines behind the router. Engine 1 is SIGKILLed while step 2 generates: its prompts go to
    engine 0, it is restarted with the current weights and rejoins. Engine 0 is SIGKILLed after step
    3: step 3's weight push fails on it, it is restarted and the push repeated. Parity on every later
    step proves each restarted engine serves the trainer's weights. The engines are tp=2 (a server
    and a follower process each): the live engine's follower, left waiting for the failed push's
    messages, must let go at once, not at the request timeout (it held the restart for two)."""
    from megarl.data.dataset import PromptBatches
    from megarl.trainer.loop import Trainer
    from megarl.trainer.metrics import MetricsLogger
    from megarl.trainer.runtime import start_runtime

    cfg = validate(
        load_config(
            ROOT / "configs/disaggregated.yaml",
            [
                f"trainer.output_dir={tmp_path}",
                "trainer.total_steps=4",
                "trainer.val_every=0",
                "data.num_train=64",
                "rollout.tp=2",
                "rollout.num_servers=2",
                "rollout.max_new_tokens=24",
                "rollout.request_timeout_s=120",
                "trainer.loggers=[console,jsonl]",
            ],
        )
    )
    metrics, killed = [], []
    with start_runtime(cfg) as rt:
        trainer = Trainer(rt, MetricsLogger(None, 4, stream=io.StringIO()))
        batches = PromptBatches(rt.train_data, cfg.data.train_batch_size, False).iterate(0, 4)
        metrics.append(trainer.train_step(1, next(batches)))
        step2, victim = run_while_killing(rt.fleet, 1, lambda: trainer.train_step(2, next(batches)))
        metrics.append(step2)
        killed.append(victim)
        restarts = rt.fleet.restarts
        os.kill(rt.fleet.server_pids()[0][0], signal.SIGKILL)  # dies before the next weight push
        trainer.weight_version = trainer.actor_version = trainer.weight_version + 1
        started = time.monotonic()
        trainer.sync_weights()
        assert rt.fleet.restarts == restarts + 1
        assert time.monotonic() - started < cfg.rollout.request_timeout_s  # ~7 s; 240 s when it waited
        metrics.append(trainer.train_step(3, next(batches)))
        metrics.append(trainer.train_step(4, next(batches)))
        pids = [p for nodes in rt.fleet.server_pids() for p in nodes]
    assert metrics[1]["rollout/engine_restarts"] == 1 and metrics[1]["rollout/retries"] >= 1
    assert [m["rollout/engine_restarts"] for m in metrics[2:]] == [0, 0]
    for m in metrics:
        assert_served_by_the_trainers_weights(m)
    assert not any(psutil.pid_exists(p) for p in pids + killed)


def test_a_parity_error_names_the_row_its_served_version_and_every_engines_version():
    """What the next parity failure says: stale weights (many rows, engines on another version)
    and a numerics branch (one row, a few tokens, the right version) read differently."""
    import numpy as np
    import torch

    from megarl.data.batch import Batch
    from megarl.trainer.parity import ParityError, check_parity, engine_versions

    class Client:
        def __init__(self, url):
            self.url = url

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def get_weight_version(self):
            if "dead" in self.url:
                raise ConnectionError("refused")
            return "3"

    class Fleet:
        engine_urls = ["http://e0", "http://dead"]
        client = staticmethod(lambda url, **kw: Client(url))

    cfg = validate(load_config(ROOT / "configs/disaggregated.yaml", []))
    old = torch.zeros(4, 3)
    rollout = old.clone()
    rollout[2, 1] = 2.5e-3  # one token of one row off
    rows = Batch(
        {
            "old_log_probs": old,
            "rollout_log_probs": rollout,
            "response_mask": torch.ones(4, 3),
            "prompt_lengths": torch.full((4,), 5),
        },
        non_tensors={"rollout_weight_version": np.array(["3"] * 4, dtype=object)},
    )
    with pytest.raises(ParityError) as error:
        check_parity(rows, 2, cfg.bridge, 3, lambda: engine_versions(Fleet()))
    message = str(error.value)
    assert "up to 2.50e-03" in message and "weight version 3" in message
    assert "row 2 (5-token prompt, response token 1" in message and "served with weight_version '3'" in message
    assert "1 tokens in 1 of 4 rows exceed" in message
    assert "http://e0: '3'" in message and "http://dead: unreachable (ConnectionError)" in message


def test_parity_tolerates_an_isolated_row_but_not_a_stale_sync():
    """bridge.parity_rows_off: one row of 256 with a token off (an MoE router near-tie) passes and
    is counted; three rows (above 1% of 256 = 2) fail, as every row of a stale sync would."""
    import torch

    from megarl.data.batch import Batch
    from megarl.trainer.parity import ParityError, check_parity

    cfg = validate(load_config(ROOT / "configs/quickstart.yaml", []))

    def check(rows):
        return check_parity(rows, 2, cfg.bridge, 1, lambda: [])

    old = torch.zeros(256, 2)

    def rows_with(off: int) -> Batch:
        rollout = old.clone()
        rollout[:off, 1] = 2.5e-3
        return Batch(
            {
                "old_log_probs": old,
                "rollout_log_probs": rollout,
                "response_mask": torch.ones(256, 2),
                "prompt_lengths": torch.full((256,), 5),
            }
        )

    metrics = check(rows_with(1))
    assert metrics["rollout/logprob_rows_off"] == 1.0 and metrics["rollout/logprob_diff_max"] == pytest.approx(2.5e-3)
    assert check(rows_with(2))["rollout/logprob_rows_off"] == 2.0
    with pytest.raises(ParityError, match="in 3 rows, more than the 2 bridge.parity_rows_off=0.01 allows"):
        check(rows_with(3))
    cfg.bridge.parity_rows_off = 0.0  # strict
    with pytest.raises(ParityError):
        check(rows_with(1))


def test_old_log_prob_auto_takes_the_rollouts_only_where_they_are_the_trainers_own():
    """actor.old_log_prob=auto resolves to rollout for the quickstart (sync, embedded engine,
    fp32, parity checked) and to recompute wherever the rollout's log-probs are not the
    trainer's own; an explicit rollout with an asynchronous loop is refused, naming the field."""
    from megarl.config.loader import ConfigError

    def resolved(*overrides):
        return validate(load_config(ROOT / "configs/quickstart.yaml", list(overrides))).actor.old_log_prob

    assert resolved() == "rollout"
    assert resolved("actor.old_log_prob=recompute") == "recompute"
    assert resolved("actor.rollout_is.level=token") == "recompute"
    assert resolved("bridge.check_parity=false") == "recompute"
    assert resolved("actor.precision=bf16") == "recompute"
    assert (
        validate(load_config(ROOT / "configs/disaggregated.yaml", ["trainer.mode=one_step_off"])).actor.old_log_prob
        == "recompute"
    )

    def rollout_is(*overrides):
        return validate(load_config(ROOT / "configs/disaggregated.yaml", list(overrides))).actor.rollout_is.level

    # the off-policy correction: on by default where rows come from older weights, off in sync
    assert rollout_is() is None and rollout_is("trainer.mode=one_step_off") == "token"
    assert rollout_is("trainer.mode=fully_async") == "token"
    assert rollout_is("trainer.mode=fully_async", "actor.rollout_is.level=null") is None
    assert rollout_is("actor.rollout_is.level=sequence") == "sequence"
    with pytest.raises(ConfigError, match="actor.old_log_prob=rollout takes the rollout engine's log-probs"):
        validate(
            load_config(
                ROOT / "configs/disaggregated.yaml", ["trainer.mode=one_step_off", "actor.old_log_prob=rollout"]
            )
        )


def test_update_parity_merges_the_ranks_first_mini_batch_and_refuses_a_stale_sync():
    """With the rollout's log-probs as the old ones, each rank's update reports parity sums of its
    first mini-batch (algo.corrections.parity_stats); the loop merges them (max of the worst
    token, sums of the rest), reports rollout/entropy from them and raises ParityError past
    bridge.parity_rows_off, as the old-log-prob pass's check does."""
    import torch

    from megarl.algo.corrections import parity_stats
    from megarl.trainer.loop import Trainer
    from megarl.trainer.parity import ParityError

    cfg = validate(load_config(ROOT / "configs/quickstart.yaml", []))
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.weight_version = cfg, 1
    trainer.rt = type("Runtime", (), {"fleet": type("Fleet", (), {"engine_urls": []})()})()
    mask = torch.ones(64, 2)

    def rank(off: int, worst: float = 2.5e-3, entropy: float = 1.0) -> dict:
        rollout = torch.zeros(64, 2)
        rollout[:off, 0] = worst
        sums = parity_stats(torch.zeros(64, 2), rollout, mask, cfg.bridge.parity_atol)
        return {
            "actor/pg_loss": 0.5,
            **{f"parity/{k}": v for k, v in sums.items()},
            "parity/entropy_sum": entropy * 128,
            "parity/entropy_tokens": 128.0,
        }

    per_rank = [rank(1), rank(0, entropy=3.0)]
    metrics = trainer._update_parity(per_rank, 2)
    assert metrics["rollout/logprob_rows_off"] == 1.0 and metrics["rollout/logprob_rows_checked"] == 128.0
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(2.5e-3)
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(2.5e-3 / 256)
    assert metrics["rollout/entropy"] == pytest.approx(2.0)
    assert per_rank == [{"actor/pg_loss": 0.5}, {"actor/pg_loss": 0.5}]  # the sums left the metrics
    with pytest.raises(ParityError, match=r"in 2 rows, more than the 1 .*\(of 128 rows checked\).*first mini-batch"):
        trainer._update_parity([rank(1), rank(1)], 2)
