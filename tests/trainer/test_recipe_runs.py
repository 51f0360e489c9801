"""The recipes through the trainer (configs/quickstart-{prime,spin,sppo}.yaml, shortened).

PRIME: the PRM worker group trains every step (its loss and grad norm logged), the accuracy band
generates further rounds, and a run stopped at a checkpoint (the PRM and its optimizer saved with
the actor) and resumed equals the uninterrupted run step for step. SPIN: the update batch holds
the chosen rows, the reference is refreshed every step and parity holds. SPPO: its targets and
loss are logged and parity holds. (That each learns the task is benchmarks/RESULTS.md's.)
"""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests._procs import _start, assert_runs_identical, whole_and_resumed
from tests.trainer.test_durability import _finish

STEPS = 4
SHORT = [
    "data.num_train=64",
    "data.train_batch_size=8",
    "rollout.n=8",
    "actor.ppo_mini_batch_size=32",
    "trainer.val_every=0",
    "trainer.loggers=[console,jsonl]",
    "trainer.deterministic=true",
    "trainer.export_hf=false",
]
PRIME = ["configs/quickstart-prime.yaml", *SHORT, "prm.mini_batch_size=64"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe_runs")
    background = ThreadPoolExecutor(1)  # PRIME's two runs beside SPIN's and SPPO's
    prime = background.submit(whole_and_resumed, root / "prime", PRIME, STEPS)
    out = {
        "prime": root / "prime" / "whole" / "quickstart-prime",
        "prime_cut": root / "prime" / "cut" / "quickstart-prime",
    }
    for name, extra in (("spin", ["ref.update_every=2"]), ("sppo", [])):
        args = [
            f"configs/quickstart-{name}.yaml",
            *SHORT,
            *extra,
            "trainer.total_steps=3",
            f"trainer.output_dir={root}",
        ]
        _finish(_start(["train", *args], uuid.uuid4().hex))
        out[name] = root / f"quickstart-{name}"
    prime.result()
    background.shutdown()
    return out


def _records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_prime_trains_its_prm_every_step_and_resumes_step_for_step(runs):
    records = _records(runs["prime"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["prm/num_updates"] == 1 and r["prm/grad_norm"] > 0
        assert 0 < r["prm/loss"] < 1 and r["prm/token_reward_abs_mean"] > 0
        assert r["rollout/gen_batches"] >= 1  # the accuracy band's rounds
        assert r["rollout/logprob_diff_max"] <= 1e-4
    assert len({r["prm/loss"] for r in records}) == STEPS
    assert (runs["prime_cut"] / "checkpoints").is_dir()
    assert_runs_identical(runs["prime"], runs["prime_cut"], STEPS)


def test_spin_trains_on_chosen_rows_against_a_refreshed_reference(runs):
    records = _records(runs["spin"])
    assert len(records) == 3
    for r in records:
        assert r["spin/chosen_length"] == 2.0  # the digit and end-of-sequence
        assert r["spin/margin"] == pytest.approx(r["spin/chosen_log_ratio"] - r["spin/rejected_log_ratio"], abs=1e-5)
        assert r["rollout/logprob_diff_max"] <= 1e-4
    # the reference is refreshed after step 2's update only (ref.update_every=2)
    assert ["ref/refresh_bytes" in r for r in records] == [False, True, False]
    # step 3's reference holds the actor's weights: its log-probs are the old ones, no forward of its own
    assert ["perf/ref_s" in r for r in records] == [True, True, False]
    assert records[2]["actor/kl"] == 0.0 and records[1]["actor/kl"] != 0.0
    # step 2 trains against the initial model, a step behind the actor: the chosen answers gained on the samples
    assert records[1]["spin/margin"] > 1e-3


def test_sppo_trains_towards_its_win_rate_targets(runs):
    records = _records(runs["sppo"])
    assert len(records) == 3
    for r in records:
        assert r["sppo/target_abs"] > 0 and "sppo/abs_error" in r
        # the win rates' spread, and the loss's targets eta (2) times it
        assert r["sppo/target_abs"] == pytest.approx(2.0 * r["sppo/win_prob_spread"], rel=1e-4)
        assert 0.5 < r["sppo/win_prob_max"] <= 1
        assert r["ref/refresh_bytes"] > 0  # ref.update_every=1: the previous iterate is the policy that sampled
        assert r["rollout/logprob_diff_max"] <= 1e-4
    # the old log-probs are the rollout's (within parity, not bit for bit the actor's): the
    # reference's forward is the step's only one, and is kept
    assert all("perf/ref_s" in r and "perf/old_log_prob_s" not in r for r in records)
