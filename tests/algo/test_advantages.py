"""Advantage estimators: a contract every registered one keeps, and each against numbers worked
out by hand (float64; the arithmetic is in the comments)."""

import math
import typing

import pytest
import torch

from megarl.algo.advantages import (
    ESTIMATORS,
    compute_advantages,
    masked_whiten,
    register_estimator,
    token_level_rewards,
)
from megarl.config.schema import AdvEstimator

torch.set_num_threads(1)
F64 = torch.float64

# two prompts x three samples, response lengths 1, 2, 3 in each group
MASK = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]] * 2)
GROUPS = ["a", "a", "a", "b", "b", "b"]
SCORES = torch.tensor([1.0, 0.0, 2.0, 3.0, 3.0, 3.0], dtype=F64)  # group b: all equal
LENGTHS = [1, 2, 3, 1, 2, 3]


def per_row(values):
    """(6, 3) tensor: row i's value on its response tokens, 0 after."""
    return torch.tensor([[v] * n + [0.0] * (3 - n) for v, n in zip(values, LENGTHS)], dtype=F64)


def whitened(rows, mean, sum_sq_dev, n=12):
    """(x - mean) / sqrt(unbiased var + 1e-8) on the response tokens of the (6, 3) `rows`."""
    return (torch.tensor(rows, dtype=F64) - mean) * MASK / math.sqrt(sum_sq_dev / (n - 1) + 1e-8)


def run(name, **kw):
    kw.setdefault("rewards", SCORES)
    return compute_advantages(name, kw.pop("rewards"), kw.pop("mask", MASK), kw.pop("groups", GROUPS), **kw)


# ------------------------------------------------------------------ the contract
def test_the_config_offers_exactly_the_registered_estimators():
    assert set(typing.get_args(AdvEstimator)) == set(ESTIMATORS)
    score_only = {n for n, e in ESTIMATORS.items() if e.score_only}
    assert score_only == {
        "grpo",
        "dr_grpo",
        "rloo",
        "opo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "sppo",
    }


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_every_estimator_keeps_the_contract(name, dtype):
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(7, 5, generator=g) > 0.3).long()
    mask[0, 0] = 1
    mask[4] = 0  # an empty response
    mask[6] = 0  # alone in its group, and empty
    rewards = torch.randn(7, generator=g).to(dtype)
    values = torch.randn(7, 5, generator=g).to(dtype)
    baseline = torch.randn(7, generator=g).to(dtype)
    process = torch.randn(7, 5, generator=g).to(dtype) * mask
    groups = [0, 0, 1, 1, 1, 2, 3]  # groups of 2 and 3, two of 1
    for r in (rewards, rewards[:, None] * mask):  # per-row scores and token-level rewards
        adv, ret = compute_advantages(
            name,
            r,
            mask,
            groups,
            values=values,
            baseline_scores=baseline,
            process_rewards=process,
            gamma=0.9,
            lam=0.8,
            norm_by_std=True,
            eps=1e-6,
        )
        for out in (adv, ret):
            assert out.shape == mask.shape and out.dtype == dtype
            assert torch.isfinite(out).all()
            assert (out[mask == 0] == 0).all()
        assert adv[mask == 1].abs().sum() > 0  # the estimator looked at the scores
    # a batch of empty responses: zeros, no NaN
    empty = torch.zeros(3, 4, dtype=torch.long)
    adv, ret = compute_advantages(
        name,
        rewards[:3],
        empty,
        [0, 0, 1],
        values=values[:3, :4],
        baseline_scores=baseline[:3],
        process_rewards=process[:3, :4],
    )
    assert (adv == 0).all() and (ret == 0).all()


def test_registry_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        run("ppo")
    with pytest.raises(TypeError, match=r"unknown advantage options \['gama'\]"):
        run("grpo", gama=0.9)
    with pytest.raises(ValueError, match="'gae' needs values"):
        run("gae")
    with pytest.raises(ValueError, match="'remax' needs baseline_scores"):
        run("remax")
    with pytest.raises(ValueError, match="'rloo' compares rows of one prompt: pass group_ids"):
        run("rloo", groups=None)
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("grpo")(lambda response_mask: None)
    with pytest.raises(TypeError, match="unknown"):
        register_estimator("new_one")(lambda response_mask, critic: None)
    assert "new_one" not in ESTIMATORS


# ------------------------------------------------------------------ hand-computed values
def test_group_estimators_hand_computed():
    # group a: scores 1, 0, 2 -> mean 1, unbiased std sqrt((0 + 1 + 1) / 2) = 1; group b: 3, 3, 3
    adv, ret = run("grpo", eps=1e-6)
    e = 1 / (1 + 1e-6)
    assert torch.allclose(adv, per_row([0, -e, e, 0, 0, 0]), atol=1e-15) and torch.equal(adv, ret)
    adv, _ = run("grpo", norm_by_std=False)
    assert torch.equal(adv, per_row([0, -1, 1, 0, 0, 0]))
    # dr_grpo never divides by the std, whatever norm_by_std says
    adv, _ = run("dr_grpo", norm_by_std=True)
    assert torch.equal(adv, per_row([0, -1, 1, 0, 0, 0]))
    # rloo: s_i - mean of the others: 1 - (0+2)/2 = 0, 0 - (1+2)/2 = -1.5, 2 - (1+0)/2 = 1.5
    adv, _ = run("rloo")
    assert torch.equal(adv, per_row([0, -1.5, 1.5, 0, 0, 0]))
    # opo: b = (1*1 + 2*0 + 3*2) / (1+2+3) = 7/6 -> -1/6, -7/6, 5/6; group b: b = 3 -> 0
    adv, _ = run("opo")
    assert torch.allclose(adv, per_row([-1 / 6, -7 / 6, 5 / 6, 0, 0, 0]), atol=1e-15)


def test_reinforce_plus_plus_baseline_hand_computed():
    # s - group mean = 0, -1, 1 | 0, 0, 0 on 1+2+3+1+2+3 = 12 tokens: sum 1 -> mean 1/12,
    # sum of squares 0 + 2 + 3 = 5 -> squared deviations 5 - 12 * (1/12)^2 = 59/12
    adv, ret = run("reinforce_plus_plus_baseline")
    expected = whitened(per_row([0, -1, 1, 0, 0, 0]).tolist(), 1 / 12, 59 / 12)
    assert torch.allclose(adv, expected, atol=1e-12) and torch.equal(adv, ret)
    # group b (all equal) was 0; the whitening moves it with the batch: (0 - 1/12) / sqrt(59/132)
    assert adv[3, 0].item() == pytest.approx(-1 / 12 / math.sqrt(59 / 132), rel=1e-7)


def test_reinforce_plus_plus_hand_computed():
    # each score on its row's last token; gamma 0.5 discounts it backwards:
    returns = [[1, 0, 0], [0, 0, 0], [0.5, 1, 2], [3, 0, 0], [1.5, 3, 0], [0.75, 1.5, 3]]
    # over the 12 response tokens: sum 17.25 -> mean 1.4375; sum of squares 38.3125 ->
    # squared deviations 38.3125 - 12 * 1.4375^2 = 13.515625
    adv, ret = run("reinforce_plus_plus", gamma=0.5)
    assert torch.equal(ret, torch.tensor(returns, dtype=F64))
    assert torch.allclose(adv, whitened(returns, 1.4375, 13.515625), atol=1e-12)
    # gamma 1 (the default): every token of a row returns its score
    _, ret = run("reinforce_plus_plus")
    assert torch.equal(ret, per_row(SCORES.tolist()))


def test_reinforce_plus_plus_carries_the_return_over_masked_tool_tokens():
    # a multi-turn row: model, tool (masked), model; reward 1 on the last token, gamma 0.5:
    # the first turn's token is one model step before it -> 0.5 (verl would restart at the gap: 0)
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    _, ret = compute_advantages("reinforce_plus_plus", torch.tensor([1.0, 0.0], dtype=F64), mask, gamma=0.5)
    assert ret.tolist() == [[0.5, 0.0, 1.0], [0.0, 0.0, 0.0]]


def test_remax_hand_computed():
    # greedy baselines 0.5 (prompt a) and 2 (prompt b): 1-0.5, 0-0.5, 2-0.5 | 3-2 three times
    baseline = torch.tensor([0.5, 0.5, 0.5, 2.0, 2.0, 2.0], dtype=F64)
    adv, ret = run("remax", baseline_scores=baseline)
    assert torch.equal(adv, per_row([0.5, -0.5, 1.5, 1, 1, 1]))
    assert torch.equal(ret, per_row(SCORES.tolist()))


def test_gae_hand_computed():
    # row 0: 3 tokens, reward 1 on the last, values 0.5, 0.25, 0.5; gamma 0.9, lam 0.5 (gamma*lam 0.45):
    #   t=2: delta = 1 + 0 - 0.5 = 0.5                  A2 = 0.5
    #   t=1: delta = 0 + 0.9*0.5 - 0.25 = 0.2           A1 = 0.2 + 0.45*0.5 = 0.425
    #   t=0: delta = 0 + 0.9*0.25 - 0.5 = -0.275        A0 = -0.275 + 0.45*0.425 = -0.08375
    #   returns A + V = 0.41625, 0.675, 1.0
    # row 1: 1 token, reward 0, value 0.2 (values past the response are ignored): A = -0.2, return 0
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    values = torch.tensor([[0.5, 0.25, 0.5], [0.2, 9.0, 9.0]], dtype=F64)
    adv, ret = compute_advantages("gae", torch.tensor([1.0, 0.0], dtype=F64), mask, values=values, gamma=0.9, lam=0.5)
    assert torch.allclose(ret, torch.tensor([[0.41625, 0.675, 1.0], [0.0, 0.0, 0.0]], dtype=F64), atol=1e-12)
    raw = [-0.08375, 0.425, 0.5, -0.2]
    mean = sum(raw) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / 3 + 1e-8)
    assert adv[0].tolist() == pytest.approx([(x - mean) / std for x in raw[:3]], abs=1e-12)
    assert adv[1].tolist() == pytest.approx([(raw[3] - mean) / std, 0, 0], abs=1e-12)
    # gamma = lam = 1: Monte Carlo, A_t = (sum of rewards from t) - V_t = 1 - V_t
    _, ret = compute_advantages("gae", torch.tensor([1.0, 0.0], dtype=F64), mask, values=values)
    assert ret.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]


# ------------------------------------------------------------------ edge cases
GROUP_ESTIMATORS = ["grpo", "dr_grpo", "rloo", "opo", "reinforce_plus_plus_baseline"]


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_single_sample_groups_give_zero(name):
    # three prompts with one sample each: no other sample to compare with -> 0 (verl: the raw score)
    adv, ret = compute_advantages(name, SCORES[:3], MASK[:3], ["x", "y", "z"])
    assert (adv == 0).all() and (ret == 0).all()


@pytest.mark.parametrize("name", GROUP_ESTIMATORS + ["reinforce_plus_plus"])
def test_all_equal_rewards_give_zero(name):
    mask = torch.tensor([[1, 1, 0]] * 4)  # equal lengths too: reinforce++'s returns are all equal
    adv, _ = compute_advantages(name, torch.full((4,), 0.7, dtype=F64), mask, ["a", "a", "b", "b"])
    assert (adv == 0).all()


def test_empty_responses():
    # opo: a group whose responses are all empty has no tokens to weight by: plain mean, no 0/0
    mask = torch.tensor([[0, 0], [0, 0], [1, 1], [1, 0]])
    adv, _ = compute_advantages("opo", torch.tensor([1.0, 0.0, 1.0, 0.0]), mask, ["a", "a", "b", "b"])
    assert torch.isfinite(adv).all() and adv[:2].eq(0).all()
    # b: (2*1 + 1*0) / 3 = 2/3 -> 1/3, -2/3
    assert adv[2].tolist() == pytest.approx([1 / 3, 1 / 3]) and adv[3].tolist() == pytest.approx([-2 / 3, 0])
    # an empty response's score has no token to land on; whitening over one token or none is 0
    assert token_level_rewards(torch.tensor([5.0, 2.0]), torch.tensor([[0, 0], [0, 1]])).tolist() == [[0, 0], [0, 2]]
    assert masked_whiten(torch.tensor([[3.0, 1.0]]), torch.tensor([[1, 0]])).tolist() == [[0.0, 0.0]]
    assert masked_whiten(torch.tensor([[3.0, 1.0]]), torch.tensor([[0, 0]])).tolist() == [[0.0, 0.0]]


def test_group_order_does_not_matter():
    perm = [4, 0, 2, 5, 1, 3]
    for name in GROUP_ESTIMATORS:
        adv, _ = run(name)
        shuffled, _ = compute_advantages(name, SCORES[perm], MASK[perm], [GROUPS[i] for i in perm])
        assert torch.allclose(shuffled, adv[perm], atol=1e-12), name
