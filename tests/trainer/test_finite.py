"""The loop's guard on non-finite values (trainer/finite.py): what it refuses, in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.data.batch import Batch
from megarl.trainer.finite import ADVANTAGES, ROLLOUT_AND_OLD, NonFiniteError, check_ranks, check_rows


def _rows(**overrides) -> Batch:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    tensors = {
        "response_mask": mask,
        "rollout_log_probs": torch.full((2, 3), -0.5),
        "old_log_probs": torch.full((2, 3), -0.5),
        "advantages": torch.ones(2, 3),
        **overrides,
    }
    return Batch(tensors, non_tensors={"rollout_weight_version": np.array(["6", "7"], dtype=object)})


@pytest.mark.parametrize("key", ["rollout_log_probs", "old_log_probs"])
def test_a_nan_log_prob_on_a_response_token_stops_the_step_naming_it(key):
    bad = torch.full((2, 3), -0.5)
    bad[1, 2] = float("nan")
    with pytest.raises(NonFiniteError) as error:
        check_rows(_rows(**{key: bad}), ROLLOUT_AND_OLD, "old/ref/values", 4, 7)
    message = str(error.value)
    assert f"({key}, old/ref/values) are non-finite at 1 response tokens in 1 rows" in message
    assert "step 4, weight version 7" in message and "row 1 (nan), served with weight_version '7'" in message
    assert "\n" not in message


def test_padding_may_hold_anything():
    pad = torch.full((2, 3), -0.5)
    pad[0, 2] = float("nan")  # row 0's third token is padding
    check_rows(_rows(old_log_probs=pad, advantages=pad.clone()), ROLLOUT_AND_OLD + ADVANTAGES, "x", 1, 1)


def test_an_infinite_advantage_stops_the_step():
    adv = torch.ones(2, 3)
    adv[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"the advantages \(advantages, advantages\) are non-finite"):
        check_rows(_rows(advantages=adv), ADVANTAGES, "advantages", 2, 1)


def test_a_rank_whose_loss_or_gradient_norm_is_nan_is_named():
    ok = {"actor/pg_loss": 0.1, "actor/grad_norm": 1.0, "actor/clipfrac": float("nan")}  # not a loss: not judged
    check_ranks([ok, ok], "actor update", 3, 2)
    with pytest.raises(NonFiniteError, match=r"actor/grad_norm is nan on rank 1 \(actor update\)"):
        check_ranks([ok, {**ok, "actor/grad_norm": float("nan")}], "actor update", 3, 2)
    with pytest.raises(NonFiniteError, match=r"critic/vf_loss is inf on rank 0 \(critic update\)"):
        check_ranks([{"critic/vf_loss": float("inf")}], "critic update", 3, 2)


def test_the_rank_whose_loss_went_nan_is_named_not_the_gradients_it_spread_to():
    # a NaN loss on rank 1 makes every rank's (all-reduced) gradient norm NaN
    spread = {"actor/pg_loss": 0.1, "actor/grad_norm": float("nan")}
    with pytest.raises(NonFiniteError, match="actor/pg_loss is nan on rank 1"):
        check_ranks([spread, {**spread, "actor/pg_loss": float("nan")}], "actor update", 3, 2)
