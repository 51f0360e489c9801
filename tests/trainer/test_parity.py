"""The weight-sync parity check's judgement (trainer/parity.py, algo/corrections.parity_stats):
non-finite log-probs and rows tolerated by count but far off."""

from __future__ import annotations

import pytest
import torch

from megarl.algo.corrections import merge_parity_stats, parity_stats
from megarl.config.schema import BridgeConfig
from megarl.data.batch import Batch
from megarl.trainer.parity import ParityError, check_parity


def _rows(rollout: torch.Tensor, mask: torch.Tensor | None = None) -> Batch:
    n, r = rollout.shape
    return Batch(
        {
            "old_log_probs": torch.full((n, r), -1.0),
            "rollout_log_probs": rollout,
            "response_mask": torch.ones(n, r) if mask is None else mask,
            "prompt_lengths": torch.full((n,), 4),
        }
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_log_prob_fails_the_check_whatever_the_tolerance(bad):
    """NaN compares False with everything: counted as 'not above atol' it would pass silently."""
    rollout = torch.full((8, 3), -1.0)
    rollout[5, 2] = bad
    lenient = BridgeConfig(parity_rows_off=0.5, parity_row_max=1e9)
    with pytest.raises(ParityError, match="1 response tokens have a non-finite log-prob"):
        check_parity(_rows(rollout), 3, lenient, 2, lambda: [])
    stats = parity_stats(torch.full((8, 3), -1.0), rollout, torch.ones(8, 3), 1e-3)
    assert stats["nonfinite"] == 1 and stats["rows_off"] == 1 and stats["diff_max"] == float("inf")


def test_a_non_finite_value_in_padding_is_not_a_difference():
    rollout = torch.full((2, 3), -1.0)
    rollout[1, 2] = float("nan")
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    metrics = check_parity(_rows(rollout, mask), 3, BridgeConfig(), 2, lambda: [])
    assert metrics["rollout/logprob_diff_max"] == 0 and metrics["rollout/logprob_nonfinite"] == 0


def test_a_row_tolerated_by_count_may_not_be_off_by_any_amount():
    """parity_rows_off lets one row of 256 past parity_atol (a near-tied MoE router); the same row
    off by an update's worth (0.3) is a broken sync of that row, not a near-tie."""
    rollout = torch.full((256, 2), -1.0)
    rollout[7, 1] = -1.0 + 5e-3
    metrics = check_parity(_rows(rollout), 3, BridgeConfig(), 2, lambda: [])
    assert metrics["rollout/logprob_rows_off"] == 1
    rollout[7, 1] = -1.0 + 0.3
    with pytest.raises(ParityError, match="beyond bridge.parity_row_max=0.05"):
        check_parity(_rows(rollout), 3, BridgeConfig(), 2, lambda: [])


def test_merged_rank_stats_keep_a_non_finite_rank():
    ok = parity_stats(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2, 2), 1e-3)
    bad = parity_stats(torch.zeros(2, 2), torch.tensor([[0.0, float("nan")], [0.0, 0.0]]), torch.ones(2, 2), 1e-3)
    for parts in ([ok, bad], [bad, ok]):
        merged = merge_parity_stats(parts)
        assert merged["nonfinite"] == 1 and merged["diff_max"] == float("inf") and merged["rows_off"] == 1
