"""Vision-language RL through the trainer (configs/vlm-shapes.yaml, shortened): every step the
engine's log-probs of the rows (its own image processing) equal the Megatron actor's (the
trainer's), every sync sends the vision tower too, the tower trains, and a run stopped at a
checkpoint and resumed equals the uninterrupted run step for step, and `megarl export` of its
checkpoint is the run's own export."""

from __future__ import annotations

import json

import pytest

from tests._procs import assert_runs_identical, run_cli, whole_and_resumed
from tests.trainer.test_durability import _tensors

STEPS = 4
RUN = [
    "configs/vlm-shapes.yaml",
    "data.num_train=64",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=32",
    "actor.micro_batch_size=16",
    "trainer.val_every=0",
    "trainer.loggers=[console,jsonl]",
    "trainer.deterministic=true",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_run")
    resumed = whole_and_resumed(root, RUN, STEPS, ("trainer.export_hf=false",))
    return {"whole": root / "whole" / "vlm-shapes", "cut": root / "cut" / "vlm-shapes", "resumed": resumed}


def test_parity_holds_and_syncs_carry_the_trained_vision_tower(runs):
    records = [json.loads(x) for x in (runs["whole"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    start, end = _tensors(runs["whole"] / "init_model"), _tensors(runs["whole"] / "hf")
    assert set(end) == set(start)
    vision = [k for k in start if k.startswith("visual.")]
    assert vision and any(not start[k].equal(end[k]) for k in vision)  # the tower trained
    for r in records:
        assert r["rollout/logprob_diff_max"] <= 1e-4, r["step"]
        assert r["rollout/logprob_rows_checked"] > 0
        assert r["bridge/tensors"] == len(start)  # the vision tower is sent with the language model
    assert len({r["actor/pg_loss"] for r in records}) > 1


def test_a_resumed_vlm_run_equals_the_uninterrupted_one(runs):
    assert f"(step {STEPS // 2}, weight version" in runs["resumed"]
    assert_runs_identical(runs["whole"], runs["cut"], STEPS)


def test_megarl_export_of_a_vlm_checkpoint_is_the_run_s_own_export(runs, tmp_path):
    """The conversion CLI names the vision tower as Qwen2.5-VL checkpoints do, and its folder is
    the uninterrupted run's end-of-run export (the runs are identical), loaded by transformers
    with no key missing or left over."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    out = run_cli("export", runs["cut"], "--step", STEPS, "--out", tmp_path / "hf")
    assert out.returncode == 0, out.stdout + out.stderr
    mine, final = _tensors(tmp_path / "hf"), _tensors(runs["whole"] / "hf")
    assert mine.keys() == final.keys() and any(k.startswith("visual.") for k in mine)
    for key, tensor in final.items():
        assert mine[key].equal(tensor), key
    _, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
