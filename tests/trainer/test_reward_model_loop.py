"""The sync loop on a classifier reward model (configs/quickstart-rm.yaml), in-process: real Ray,
Megatron ranks, the embedded engine and the reward model's worker group on slivers of the actor
devices. The rewards the advantage estimator (and so the loss) received are recomputed without
megarl: Hugging Face's float64 score of each row's tokens, normalised by the mean and std of every
row trained on so far; float32 scoring and normalisation agree to 1e-3. The rule verifier's score is
logged beside it, and the statistics are in the run's checkpoint."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megarl.config.loader import load_config
from megarl.config.validate import validate
from megarl.reward.normalize import EPS
from megarl.reward.rule import digits_score
from tests._reward_models import hf_float64, save_reward_model

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megarl.trainer.loop import Trainer
    from megarl.trainer.metrics import MetricsLogger
    from megarl.trainer.runtime import start_runtime

    out = tmp_path_factory.mktemp("rm_loop")
    rm = save_reward_model(out / "rm")
    cfg = validate(
        load_config(
            ROOT / "configs/quickstart-rm.yaml",
            [
                f"trainer.output_dir={out}",
                f"trainer.total_steps={STEPS}",
                "trainer.val_every=0",
                "trainer.loggers=[console,jsonl]",
                "trainer.export_hf=false",
                f"trainer.save_every={STEPS}",
                "data.num_train=64",
                "rollout.n=4",
                "actor.ppo_mini_batch_size=32",
                "actor.micro_batch_size=16",
                "reward.model.preset=null",
                f"reward.model.path={rm}",
            ],
        )
    )
    seen = []
    with start_runtime(cfg) as rt:
        console = io.StringIO()
        logger = MetricsLogger(None, STEPS, stream=console, jsonl_path=out / "metrics.jsonl")
        trainer = Trainer(rt, logger)
        estimator_rewards = trainer._rewards

        def spy(rows):  # what the advantage estimator is handed, with the rows it belongs to
            rewards, metrics = estimator_rewards(rows)
            seen.append((rows.select(*rows.keys()), rewards.clone()))
            return rewards, metrics

        trainer._rewards = spy
        trainer.fit()
        logger.close()
        workers = len(rt.reward_workers.group.actors)
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    state = json.loads((out / f"quickstart-rm/checkpoints/step_{STEPS:06d}/trainer_state.json").read_text())
    return rm, seen, steps, workers, state, console.getvalue()


def test_the_loss_saw_the_reward_models_normalised_scores_and_the_ground_truth_is_logged(run):
    rm, seen, steps, workers, state, console = run
    assert len(seen) == len(steps) == STEPS and workers == 2  # one reward-model rank per actor device
    trained = []
    for (rows, rewards), metrics in zip(seen, steps):
        mask = rows["response_mask"] > 0
        ends = (torch.arange(1, mask.shape[1] + 1) * mask).amax(1)
        lengths = (rows["prompt_lengths"] + ends).tolist()
        trained.append(hf_float64(rm, [ids[:n] for ids, n in zip(rows["input_ids"], lengths)]))
        everything = np.concatenate(trained)  # every row trained on so far: the running statistics
        expected = (trained[-1] - everything.mean()) / (everything.std() + EPS)
        np.testing.assert_allclose(rewards.numpy(), expected, atol=1e-3, rtol=0)
        assert metrics["reward/mean"] == pytest.approx(expected.mean(), abs=1e-3)
        assert metrics["reward/model_mean"] == pytest.approx(trained[-1].mean(), abs=1e-4)
        rule = [digits_score(t, g, {}) for t, g in zip(rows["response_text"], rows["ground_truth"])]
        assert metrics["reward/ground_truth_mean"] == pytest.approx(float(np.mean(rule)), abs=1e-6)
        assert metrics["reward/model_failures"] == 0.0
        # the step line shows the verifier's score beside the model's
        assert f"step {metrics['step']}/{STEPS} | reward " in console
        assert f"truth {metrics['reward/ground_truth_mean']:.3f} | len" in console.split(f"step {metrics['step']}/")[1]
    # the checkpoint carries the running statistics a resumed run continues from
    norm = state["reward_norm"]
    assert norm["count"] == everything.size == STEPS * 64
    assert norm["mean"] == pytest.approx(everything.mean(), abs=1e-4)
    assert np.sqrt(norm["m2"] / norm["count"]) == pytest.approx(everything.std(), abs=1e-4)
