"""ReMax's greedy baseline (trainer/remax.py): one greedy response per distinct prompt, its score
mapped back onto every sampled row of that prompt, whatever order the rows are in."""

import numpy as np
import pytest
import torch

from megarl.data.batch import Batch
from megarl.trainer.remax import greedy_baselines, prompt_rows


def sampled_rows():
    # prompts p, q, r with 2 samples each, interleaved (as after balancing), r appearing in two
    # dynamic-sampling rounds (same uid twice over): each prompt must be generated once
    uids = ["q", "p", "r", "q", "p", "r"]
    return Batch(
        tensors={"scores": torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0]), "response_mask": torch.ones(6, 2)},
        non_tensors={
            "uid": uids,
            "raw_prompt_ids": [[ord(u)] for u in uids],
            "data_source": ["digits"] * 6,
            "ground_truth": [u.upper() for u in uids],
            "extra_info": [{"u": u} for u in uids],
            "response_text": ["x"] * 6,
            "finish_reason": ["stop"] * 6,
            "rollout_weight_version": ["3"] * 6,
        },
    )


def test_prompt_rows_keeps_each_uid_once_and_only_the_prompt_columns():
    prompts, index = prompt_rows(sampled_rows())
    assert list(prompts["uid"]) == ["q", "p", "r"]
    assert list(prompts["ground_truth"]) == ["Q", "P", "R"]
    assert sorted(prompts.non_tensors) == ["data_source", "extra_info", "ground_truth", "raw_prompt_ids", "uid"]
    assert index.tolist() == [0, 1, 2, 0, 1, 2]


def test_each_row_gets_its_own_prompts_greedy_score():
    rows, calls = sampled_rows(), []
    greedy_score = {"p": 0.25, "q": 0.75, "r": 1.0}

    def generate(prompts):
        calls.append(list(prompts["uid"]))
        return prompts.union(Batch(tensors={"response_mask": torch.ones(len(prompts), 3)}))

    def score(out):
        return torch.tensor([greedy_score[u] for u in out["uid"]])

    baseline, metrics = greedy_baselines(rows, generate, score)
    assert calls == [["q", "p", "r"]]  # one greedy rollout, each prompt once
    assert baseline.tolist() == [0.75, 0.25, 1.0, 0.75, 0.25, 1.0]
    assert metrics["remax/baseline_mean"] == pytest.approx(2.0 / 3)
    assert metrics["remax/greedy_length_mean"] == 3.0
    # rows beating their baseline: q 1>0.75, p 1>0.25 (row 4); r never beats 1.0
    assert metrics["remax/beats_baseline_frac"] == pytest.approx(2 / 6)


def test_a_short_greedy_rollout_is_an_error_not_a_misaligned_baseline():
    rows = sampled_rows()
    with pytest.raises(RuntimeError, match="returned 2 rows for 3 prompts"):
        greedy_baselines(rows, lambda p: p[np.arange(2)], lambda out: torch.zeros(len(out)))
