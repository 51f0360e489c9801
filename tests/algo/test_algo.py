"""Advantages, losses and KL against hand-computed values (the arithmetic is in the comments)."""

import math

import numpy as np
import pytest
import torch

from megarl.algo import (
    agg_loss,
    entropy_from_logits,
    entropy_loss,
    group_normalized_scores,
    grpo_advantages,
    kl_loss,
    kl_penalty,
    masked_mean,
    policy_loss,
)

torch.set_num_threads(1)
TOL = dict(rel=1e-5, abs=1e-6)


# ------------------------------------------------------------------ GRPO advantages
def test_grpo_advantages_hand_computed():
    # group a = rows 0, 1, 3 with scores 1, 0, 1: mean 2/3,
    # unbiased std = sqrt(((1/3)^2 + (2/3)^2 + (1/3)^2) / 2) = sqrt(1/3) = 0.577350
    # adv = (1 - 2/3) / 0.577350 = 0.577350 ; (0 - 2/3) / 0.577350 = -1.154701
    # group b = row 2 alone -> 0
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    adv = grpo_advantages(scores, mask, np.array(["a", "a", "b", "a"], dtype=object))
    expected_row = [0.577350, -1.154701, 0.0, 0.577350]
    for i, value in enumerate(expected_row):
        assert adv[i].tolist() == pytest.approx([value * m for m in mask[i].tolist()], **TOL)
    assert adv.shape == mask.shape and adv.dtype == torch.float32


def test_grpo_without_std_is_mean_centering():
    adv = group_normalized_scores(torch.tensor([1.0, 0.0, 0.5, 1.0]), ["a", "a", "b", "a"], norm_by_std=False)
    # 1 - 2/3, 0 - 2/3, alone, 1 - 2/3
    assert adv.tolist() == pytest.approx([1 / 3, -2 / 3, 0.0, 1 / 3], **TOL)


def test_grpo_equal_scores_give_zero_and_order_does_not_matter():
    adv = group_normalized_scores(torch.tensor([0.3, 0.3, 0.3]), [7, 7, 7])
    assert adv.tolist() == [0.0, 0.0, 0.0]
    # interleaved groups: x = rows 0, 2 (scores 0, 1); y = rows 1, 3 (scores 4, 2)
    # x: mean 0.5, std sqrt((0.25 + 0.25) / 1) = 0.707107 -> -0.707107, +0.707107
    # y: mean 3, std sqrt((1 + 1) / 1) = 1.414214 -> +0.707107, -0.707107
    adv = group_normalized_scores(torch.tensor([0.0, 4.0, 1.0, 2.0]), ["x", "y", "x", "y"])
    assert adv.tolist() == pytest.approx([-0.707107, 0.707107, 0.707107, -0.707107], **TOL)


def test_grpo_token_level_rewards_are_summed_inside_the_mask():
    # row scores: 0 + 0 + 1 (reward on the last response token) = 1, and 0 -> adv +-0.707107
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = grpo_advantages(rewards, mask, ["g", "g"])
    assert adv[0].tolist() == pytest.approx([0.707107] * 3, **TOL)
    assert adv[1].tolist() == pytest.approx([-0.707107, -0.707107, 0.0], **TOL)


def test_grpo_rejects_misaligned_group_ids():
    with pytest.raises(ValueError, match="group_ids has 2 entries but there are 3 rows"):
        grpo_advantages(torch.zeros(3), torch.ones(3, 2), ["a", "b"])
    with pytest.raises(ValueError, match="response_mask must be"):
        grpo_advantages(torch.zeros(3), torch.ones(2, 2), ["a", "b", "c"])


# ------------------------------------------------------------------ aggregation
VALUES = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3) / 3),  # 2.0
        ("seq-mean-token-sum", ((1 + 2) + 3) / 2),  # 3.0
        ("seq-mean-token-mean", (1.5 + 3) / 2),  # 2.25
    ],
)
def test_agg_loss_modes(mode, expected):
    assert agg_loss(VALUES, MASK, mode).item() == pytest.approx(expected, **TOL)


def test_agg_loss_global_denominator_and_bad_mode():
    # two micro-batches summing into a global token mean over 6 tokens: 6/6 + 6/6 = 2
    assert agg_loss(VALUES, MASK, "token-mean", global_denominator=6).item() == pytest.approx(1.0)
    assert agg_loss(VALUES, MASK, "seq-mean-token-sum", global_denominator=4).item() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="loss_agg_mode='mean'"):
        agg_loss(VALUES, MASK, "mean")
    assert masked_mean(VALUES, torch.zeros(2, 2)).item() == 0.0


# ------------------------------------------------------------------ policy loss
def _policy_inputs(dtype=torch.float32):
    # ratios r = [[1.5, 0.5], [1.5, 0.5]], advantages [[+1, +1], [-1, -1]], clip 0.2:
    #  r=1.5 A=+1: -1.5 vs clipped -1.2 -> -1.2 (clipped branch active)
    #  r=0.5 A=+1: -0.5 vs clipped -0.8 -> -0.5
    #  r=1.5 A=-1: +1.5 vs clipped +1.2 -> +1.5
    #  r=0.5 A=-1: +0.5 vs clipped +0.8 -> +0.8 (clipped branch active; masked out below)
    old = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]], dtype=dtype)
    ratio = torch.tensor([[1.5, 0.5], [1.5, 0.5]], dtype=dtype)
    log_prob = old + torch.log(ratio)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=dtype)
    return log_prob, old, adv


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (-1.2 - 0.5 + 1.5) / 3),  # -0.066667
        ("seq-mean-token-sum", ((-1.2 - 0.5) + 1.5) / 2),  # -0.1
        ("seq-mean-token-mean", ((-1.2 - 0.5) / 2 + 1.5) / 2),  # 0.325
    ],
)
def test_policy_loss_hand_computed(mode, expected):
    log_prob, old, adv = _policy_inputs()
    loss, metrics = policy_loss(log_prob, old, adv, MASK, 0.2, 0.2, mode)
    assert loss.item() == pytest.approx(expected, **TOL)
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 3, **TOL)  # only token (0, 0)
    # ppo_kl = mean(old - new) = -(ln 1.5 + ln 0.5 + ln 1.5) / 3 = -0.0719205
    assert metrics["ppo_kl"].item() == pytest.approx(-(2 * math.log(1.5) + math.log(0.5)) / 3, **TOL)
    assert not metrics["pg_clipfrac"].requires_grad


def test_policy_loss_asymmetric_clip_and_full_mask():
    log_prob, old, adv = _policy_inputs()
    # clip high 0.28: token (0, 0) -> -1.28; all four tokens: (-1.28 - 0.5 + 1.5 + 0.8) / 4 = 0.13
    loss, metrics = policy_loss(log_prob, old, adv, torch.ones(2, 2), 0.2, 0.28, "token-mean")
    assert loss.item() == pytest.approx(0.13, **TOL)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5, **TOL)


def test_policy_loss_on_policy_equals_minus_mean_advantage():
    lp = torch.randn(3, 4)
    adv = torch.randn(3, 4)
    loss, metrics = policy_loss(lp, lp.clone(), adv, torch.ones(3, 4))
    assert loss.item() == pytest.approx(-adv.mean().item(), **TOL)
    assert metrics["pg_clipfrac"].item() == 0.0 and metrics["ppo_kl"].item() == 0.0


def test_policy_loss_gradient_zero_in_clipped_region_and_signed_elsewhere():
    log_prob, old, adv = _policy_inputs(torch.float64)
    log_prob.requires_grad_(True)
    loss, _ = policy_loss(log_prob, old, adv, MASK, 0.2, 0.2, "token-mean")
    loss.backward()
    # d/dlp of -A * exp(lp - old) / 3 = -A * r / 3 where the unclipped branch is active
    assert log_prob.grad.flatten().tolist() == pytest.approx([0.0, -0.5 / 3, 1.5 / 3, 0.0], **TOL)
    # descent raises the log-prob of the positive-advantage token (grad < 0) and lowers the
    # negative one (grad > 0)


def test_policy_loss_gradient_matches_finite_differences():
    torch.manual_seed(0)
    old = torch.randn(3, 5, dtype=torch.float64)
    # keep ratios away from the clip boundaries 0.8 and 1.2, where the loss has kinks
    offsets = torch.tensor([-0.6, -0.1, 0.05, 0.1, 0.5], dtype=torch.float64).repeat(3, 1)
    log_prob = (old + offsets).requires_grad_(True)
    adv = torch.randn(3, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert torch.autograd.gradcheck(lambda lp: policy_loss(lp, old, adv, mask, 0.2, 0.2, mode)[0], (log_prob,))


def test_policy_loss_shape_mismatch():
    with pytest.raises(ValueError, match="must share a shape"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))


def test_policy_loss_huge_ratio_stays_finite():
    loss, _ = policy_loss(torch.tensor([[100.0]]), torch.tensor([[0.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1))
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(math.exp(20), rel=1e-4)


# ------------------------------------------------------------------ KL
LP, REF = math.log(0.5), math.log(0.25)  # log p - log q = ln 2 = 0.693147


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("k1", 0.693147),  # ln 2
        ("k2", 0.5 * 0.693147**2),  # 0.240227
        ("k3", 0.5 + 0.693147 - 1),  # q/p - ln(q/p) - 1 = 0.5 + ln 2 - 1 = 0.193147
        ("low_var_kl", 0.5 + 0.693147 - 1),
    ],
)
def test_kl_penalty_hand_computed(kind, expected):
    value = kl_penalty(torch.tensor([LP]), torch.tensor([REF]), kind)
    assert value.item() == pytest.approx(expected, **TOL)


def test_kl_estimators_are_unbiased_in_expectation():
    # E_p[k1] = E_p[k3] = KL(p || q) exactly; k2 is biased (and >= 0)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))  # 0.183378
    for kind in ("k1", "k3", "low_var_kl"):
        estimate = (p * kl_penalty(p.log(), q.log(), kind)).sum().item()
        assert estimate == pytest.approx(exact, rel=1e-9), kind
    assert (kl_penalty(p.log(), q.log(), "k2") >= 0).all()


def test_low_var_kl_is_clamped_and_k3_is_not():
    # log q - log p = -30: k3 = e^-30 + 30 - 1 = 29; low_var_kl clamps to 10
    lp, ref = torch.tensor([0.0]), torch.tensor([-30.0])
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(29.0, **TOL)
    assert kl_penalty(lp, ref, "low_var_kl").item() == 10.0
    # log q - log p = +30: e^30 - 31 = 1.0686e13 unclamped; low_var_kl stays finite at 10
    assert kl_penalty(ref, lp, "k3").item() == pytest.approx(math.exp(30) - 31, rel=1e-5)
    assert kl_penalty(ref, lp, "low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="kl kind 'k4'"):
        kl_penalty(lp, ref, "k4")


def test_kl_loss_aggregates_like_the_policy_loss():
    lp = torch.tensor([[LP, LP], [0.0, 5.0]])
    ref = torch.tensor([[REF, REF], [0.0, 0.0]])
    # k1 tokens: ln 2, ln 2, 0 (and 5, masked) -> token-mean 2 ln 2 / 3 = 0.462098
    assert kl_loss(lp, ref, MASK, "k1").item() == pytest.approx(2 * 0.693147 / 3, **TOL)


# ------------------------------------------------------------------ entropy
def test_entropy_hand_computed_and_stable():
    logits = torch.log(torch.tensor([[0.5, 0.5], [0.7, 0.3]]))
    # ln 2 = 0.693147 ; -(0.7 ln 0.7 + 0.3 ln 0.3) = 0.249672 + 0.361192 = 0.610864
    assert entropy_from_logits(logits).tolist() == pytest.approx([0.693147, 0.610864], **TOL)
    assert entropy_from_logits(torch.tensor([[1000.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-6)
    # shift invariance: adding a constant to every logit leaves entropy unchanged
    assert entropy_from_logits(logits + 50).tolist() == pytest.approx([0.693147, 0.610864], **TOL)


def test_entropy_loss_uses_the_mask():
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.7, 0.3]], [[0.5, 0.5], [0.5, 0.5]]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # token-mean over (ln 2, 0.610864, ln 2) = 0.665719
    assert entropy_loss(logits, mask, "token-mean").item() == pytest.approx((2 * 0.693147 + 0.610864) / 3, **TOL)
