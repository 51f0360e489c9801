"""Policy losses (every registered one), the rollout-IS correction, and their config.

Gradients are checked two ways in float64: torch.autograd.gradcheck (analytic vs finite
differences, away from the clip kinks) and against gradients derived by hand in the comments,
at points where each clip / bound is active and where it is not.
"""

import math
import typing

import pytest
import torch

from megarl.algo import (
    POLICY_LOSSES,
    PolicyLossConfig,
    get_policy_loss,
    mismatch_metrics,
    register_policy_loss,
    rollout_is_weights,
)
from megarl.algo.losses import cispo_policy_loss, gspo_policy_loss, vanilla_policy_loss
from megarl.algo.sequence_losses import SEQUENCE_LOSSES
from megarl.config import ConfigError, load_config, validate
from megarl.config.schema import ActorConfig
from megarl.models.tiny import TINY_QWEN3_MOE

torch.set_num_threads(1)
F64 = torch.float64
TOL = dict(rel=1e-9, abs=1e-12)
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def _inputs(seed=0, rows=3, cols=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g, dtype=F64) * 3
    lp = old + torch.randn(rows, cols, generator=g, dtype=F64) * 0.3
    adv = torch.randn(rows, 1, generator=g, dtype=F64).expand(rows, cols).clone()  # per row
    mask = torch.ones(rows, cols, dtype=F64)
    mask[0, 3:] = 0
    mask[1, 1:] = 0
    return lp, old, adv, mask


# ------------------------------------------------------------------ contract: every registered loss
def test_registry_matches_the_schema():
    names = typing.get_args(typing.get_type_hints(ActorConfig)["policy_loss"])
    # the token-level losses, and the sequence losses the actor trains with (algo/sequence_losses.py)
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "cispo"}
    assert set(names) == set(POLICY_LOSSES) | (set(SEQUENCE_LOSSES) - {"prime_ce"})
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="not registered; known"):
        get_policy_loss("ppo2")


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", MODES)
def test_contract_finite_scalar_masked_tokens_get_no_gradient(name, mode):
    lp, old, adv, mask = _inputs()
    lp = lp.clone()
    lp[mask == 0] = 30.0  # garbage off the response: a ratio of e^30 there must not leak
    lp.requires_grad_(True)
    cfg = PolicyLossConfig(clip_ratio_c=3.0)
    loss, metrics = get_policy_loss(name)(lp, old, adv, mask, cfg, mode)
    assert loss.shape == () and math.isfinite(loss.item())
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[mask == 0] == 0).all() and (lp.grad[mask == 1] != 0).any()
    assert {"pg_loss", "pg_clipfrac", "ppo_kl"} <= set(metrics)
    assert all(not v.requires_grad and v.shape == () and math.isfinite(v.item()) for v in metrics.values())
    with pytest.raises(ValueError, match="must share a shape"):
        get_policy_loss(name)(lp, old, adv[:, :2], mask, cfg, mode)
    with pytest.raises(ValueError, match="must share a shape"):
        get_policy_loss(name)(lp, old, adv, mask, cfg, mode, weights=torch.ones(3, 4, dtype=F64))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_contract_on_policy_gradient_is_the_policy_gradient(name):
    # at logp == old every loss's gradient is -A / N per token (token-mean): plain REINFORCE
    lp, _, adv, mask = _inputs(1)
    lp = lp.clone().requires_grad_(True)
    loss, metrics = get_policy_loss(name)(lp, lp.detach().clone(), adv, mask)
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv * mask / mask.sum(), rtol=1e-12, atol=1e-15)
    assert metrics["pg_clipfrac"].item() == 0.0 and metrics["ppo_kl"].item() == 0.0


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_contract_weights_scale_each_token_and_carry_no_gradient(name):
    lp, old, adv, mask = _inputs(2)
    w = torch.rand(lp.shape, dtype=F64, generator=torch.Generator().manual_seed(3)) + 0.5
    w.requires_grad_(True)
    fn = get_policy_loss(name)
    lp1 = lp.clone().requires_grad_(True)
    fn(lp1, old, adv, mask, weights=w)[0].backward()
    lp2 = lp.clone().requires_grad_(True)
    fn(lp2, old, adv, mask)[0].backward()
    torch.testing.assert_close(lp1.grad, lp2.grad * w.detach(), rtol=1e-12, atol=1e-15)
    assert w.grad is None


# ------------------------------------------------------------------ vanilla (+ clip-higher, dual-clip)
# (A, r) with clip 0.2 / 0.28 and clip_ratio_c 3; per-token loss and d loss / d logp (= dL/dr * r):
VANILLA_POINTS = [
    (1.0, 1.1, -1.1, -1.1),  # inside the range: -A r, gradient -A r
    (1.0, 1.5, -1.28, 0.0),  # A > 0, r > 1.28: clipped at 1 + high, no gradient
    (1.0, 0.5, -0.5, -0.5),  # A > 0, r < 0.8: max(-0.5, -0.8) keeps the unclipped branch
    (-1.0, 0.5, 0.8, 0.0),  # A < 0, r < 0.8: clipped at 1 - low, no gradient
    (-1.0, 2.0, 2.0, 2.0),  # A < 0, 1.28 < r < c: unclipped, gradient -A r
    (-1.0, 5.0, 3.0, 0.0),  # A < 0, r > c = 3: the dual-clip bound -A c, no gradient
    (-2.0, 1.0, 2.0, 2.0),  # on-policy
]


def _points(points):
    adv = torch.tensor([[p[0] for p in points]], dtype=F64)
    old = torch.full_like(adv, -1.0)
    lp = (old + torch.log(torch.tensor([[p[1] for p in points]], dtype=F64))).requires_grad_(True)
    return lp, old, adv, torch.ones_like(adv)


def test_vanilla_dual_clip_hand_derived():
    lp, old, adv, mask = _points(VANILLA_POINTS)
    n = len(VANILLA_POINTS)
    loss, metrics = vanilla_policy_loss(lp, old, adv, mask, PolicyLossConfig(0.2, 0.28, 3.0))
    loss.backward()
    assert loss.item() == pytest.approx(sum(p[2] for p in VANILLA_POINTS) / n, **TOL)
    assert lp.grad[0].tolist() == pytest.approx([p[3] / n for p in VANILLA_POINTS], **TOL)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / n, **TOL)  # points 2 and 4
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / n, **TOL)  # point 6


def test_vanilla_without_dual_clip_lets_a_negative_token_grow():
    lp, old, adv, mask = _points(VANILLA_POINTS)
    loss, metrics = vanilla_policy_loss(lp, old, adv, mask, PolicyLossConfig(0.2, 0.28))
    loss.backward()
    # point 6 now costs -A r = 5 with gradient 5; the rest are unchanged
    expected = [p[3] for p in VANILLA_POINTS]
    expected[5] = 5.0
    assert lp.grad[0].tolist() == pytest.approx([e / len(expected) for e in expected], **TOL)
    assert "pg_clipfrac_lower" not in metrics


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_vanilla_gradcheck(mode, dual):
    g = torch.Generator().manual_seed(5)
    old = torch.randn(3, 5, generator=g, dtype=F64)
    # ratios away from the kinks 0.8, 1.28 and 3
    offsets = torch.log(torch.tensor([0.5, 0.9, 1.1, 2.0, 4.0], dtype=F64)).repeat(3, 1)
    lp = (old + offsets).requires_grad_(True)
    adv = torch.randn(3, 5, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=F64)
    w = torch.rand(3, 5, generator=g, dtype=F64) + 0.5
    cfg = PolicyLossConfig(0.2, 0.28, dual)
    assert torch.autograd.gradcheck(lambda x: vanilla_policy_loss(x, old, adv, mask, cfg, mode)[0], (lp,))
    assert torch.autograd.gradcheck(lambda x: vanilla_policy_loss(x, old, adv, mask, cfg, mode, weights=w)[0], (lp,))


# ------------------------------------------------------------------ gspo
def _gspo_sequence_level(lp, old, adv_row, mask, low, high, mode):
    """GSPO as the paper writes it, independently: s_i = exp(mean_t(logp - old)) with the gradient
    through s_i, objective max(-A s, -A clip(s)) per sequence."""
    lengths = mask.sum(-1)
    s = torch.exp(((lp - old) * mask).sum(-1) / lengths)
    per_seq = torch.maximum(-adv_row * s, -adv_row * s.clamp(1 - low, 1 + high))
    if mode == "seq-mean-token-mean":
        return per_seq.mean()
    if mode == "token-mean":
        return (per_seq * lengths).sum() / lengths.sum()
    return (per_seq * lengths).mean()


@pytest.mark.parametrize("mode", MODES)
def test_gspo_gradient_equals_the_sequence_level_objective(mode):
    # token form with a per-row advantage: d/dlogp_t of the token loss = s_i * (-A_i) * (row weight)
    # = the sequence-level gradient, since d s_i / d logp_t = s_i / |y_i| and each row's |y_i|
    # tokens carry the same value
    lp, old, adv, mask = _inputs(4)
    # GSPO-sized ratios: row means -9e-6, 6.4e-4 (A > 0: clipped), 2.2e-4
    lp = (old + (lp - old) * 3e-3).detach()
    cfg = PolicyLossConfig(gspo_clip_ratio_low=3e-4, gspo_clip_ratio_high=4e-4)
    x1 = lp.clone().requires_grad_(True)
    loss, metrics = gspo_policy_loss(x1, old, adv, mask, cfg, mode)
    loss.backward()
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 9, **TOL)  # row 1's one token
    x2 = lp.clone().requires_grad_(True)
    _gspo_sequence_level(x2, old, adv[:, 0], mask, 3e-4, 4e-4, mode).backward()
    torch.testing.assert_close(x1.grad, x2.grad * mask, rtol=1e-10, atol=1e-14)
    assert torch.autograd.gradcheck(
        lambda x: gspo_policy_loss(x, old, adv, mask, cfg, mode)[0], (lp.clone().requires_grad_(True),)
    )


def test_gspo_hand_derived():
    # rows: token log-ratios, A; s = exp(mean); range [1 - 3e-4, 1 + 4e-4]
    #   row 0: [1e-4, 3e-4], A = 1:  s = e^2e-4 inside -> loss -s per token, gradient -s
    #   row 1: [1e-3, 1e-3], A = 1:  s = e^1e-3 > 1.0004 -> clipped, -1.0004, gradient 0
    #   row 2: [-1e-3, pad], A = -1: s = e^-1e-3 < 0.9997 -> max(s, 0.9997) = 0.9997, gradient 0
    #   row 3: [2e-3, 2e-3], A = -1: s = e^2e-3 > 1 + 4e-4 -> max(s, 1.0004) = s, gradient +s
    ratios = torch.tensor([[1e-4, 3e-4], [1e-3, 1e-3], [-1e-3, 0.0], [2e-3, 2e-3]], dtype=F64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=F64).unsqueeze(-1).expand(4, 2).clone()
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]], dtype=F64)
    old = torch.full_like(ratios, -2.0)
    lp = (old + ratios).requires_grad_(True)
    loss, metrics = gspo_policy_loss(lp, old, adv, mask, PolicyLossConfig(), "token-mean")
    loss.backward()
    s0, s3 = math.exp(2e-4), math.exp(2e-3)
    n = 7
    assert loss.item() == pytest.approx((-2 * s0 - 2 * 1.0004 + 0.9997 + 2 * s3) / n, rel=1e-12)
    expected = [[-s0 / n, -s0 / n], [0, 0], [0, 0], [s3 / n, s3 / n]]
    assert lp.grad.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in expected]
    assert metrics["pg_clipfrac"].item() == pytest.approx(3 / n, **TOL)  # rows 1 (2 tokens), 2 (1)


# ------------------------------------------------------------------ cispo
# (A, r) -> gradient -A * clip(r, 1 - low, 1 + high), here with low = 1 (no lower bound) or 0.2
CISPO_POINTS = [
    (1.0, 1.5, 1.28, 1.28),
    (1.0, 0.5, 0.5, 0.8),
    (-1.0, 2.0, 1.28, 1.28),
    (-1.0, 0.9, 0.9, 0.9),
    (2.0, 1.0, 1.0, 1.0),
]


@pytest.mark.parametrize("low, column", [(1.0, 2), (0.2, 3)])
def test_cispo_hand_derived(low, column):
    lp, old, adv, mask = _points(CISPO_POINTS)
    n = len(CISPO_POINTS)
    loss, metrics = cispo_policy_loss(lp, old, adv, mask, PolicyLossConfig(cispo_clip_ratio_low=low))
    loss.backward()
    w = [p[column] for p in CISPO_POINTS]
    # loss = mean(-A w logp); logp = -1 + ln r
    expected = sum(-p[0] * wi * (-1 + math.log(p[1])) for p, wi in zip(CISPO_POINTS, w)) / n
    assert loss.item() == pytest.approx(expected, **TOL)
    assert lp.grad[0].tolist() == pytest.approx([-p[0] * wi / n for p, wi in zip(CISPO_POINTS, w)], **TOL)
    clipped = 2 if low == 1.0 else 3
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped / n, **TOL)


@pytest.mark.parametrize("mode", MODES)
def test_cispo_gradcheck_with_the_weight_frozen(mode):
    # the IS weight is a constant to the gradient, so the gradient at x0 is the derivative of the
    # loss along a path that keeps r fixed: old moves with x (old = old0 + x - x0), the weight does not
    lp, old0, adv, mask = _inputs(6)
    adv = torch.randn(adv.shape, dtype=F64, generator=torch.Generator().manual_seed(7))  # per token
    x0 = lp.clone()
    cfg = PolicyLossConfig(cispo_clip_ratio_low=0.2)
    assert torch.autograd.gradcheck(
        lambda x: cispo_policy_loss(x, old0 + (x - x0), adv, mask, cfg, mode)[0], (lp.clone().requires_grad_(True),)
    )


# ------------------------------------------------------------------ rollout IS
def test_rollout_is_token_and_sequence_hand_checked():
    # row 0: trainer/rollout probabilities .5/.25, .5/.5, .2/.5 -> ratios 2, 1, 0.4
    # row 1: .5/.25, .5/.25, pad -> ratios 2, 2
    old = torch.log(torch.tensor([[0.5, 0.5, 0.2], [0.5, 0.5, 0.9]], dtype=F64))
    rollout = torch.log(torch.tensor([[0.25, 0.5, 0.5], [0.25, 0.25, 0.1]], dtype=F64))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    w, m = rollout_is_weights(old, rollout, mask, "token", 1.5)
    # truncated at 1.5: [1.5, 1, 0.4], [1.5, 1.5, 0]; mean over 5 tokens 5.9 / 5; 3 of 5 truncated
    assert w.tolist() == [pytest.approx([1.5, 1.0, 0.4], **TOL), pytest.approx([1.5, 1.5, 0.0], **TOL)]
    assert m["rollout_is/mean"].item() == pytest.approx(5.9 / 5, **TOL)
    assert m["rollout_is/clipfrac"].item() == pytest.approx(3 / 5, **TOL)
    assert m["rollout_is/spread"].item() == pytest.approx((0.5 + 0 + 0.6 + 0.5 + 0.5) / 5, **TOL)
    w, m = rollout_is_weights(old, rollout, mask, "sequence", 1.5)
    # products: 2 * 1 * 0.4 = 0.8 (kept), 2 * 2 = 4 -> 1.5; per row, zero off the response
    assert w.tolist() == [pytest.approx([0.8] * 3, **TOL), pytest.approx([1.5, 1.5, 0.0], **TOL)]
    assert m["rollout_is/mean"].item() == pytest.approx((0.8 + 1.5) / 2, **TOL)
    assert m["rollout_is/clipfrac"].item() == pytest.approx(0.5, **TOL)
    assert not w.requires_grad
    # KL(rollout || trainer) estimate: mean of rollout - old = -(ln 2 + 0 + ln .4 + 2 ln 2) / 5
    kl = mismatch_metrics(old, rollout, mask)["rollout/mismatch_kl"].item()
    assert kl == pytest.approx(-(3 * math.log(2) + math.log(0.4)) / 5, **TOL)


def test_rollout_is_huge_ratio_does_not_overflow():
    old, rollout = torch.tensor([[0.0] * 4]), torch.tensor([[-50.0] * 4])  # sum 200: e^200 = inf in fp32
    w, _ = rollout_is_weights(old, rollout, torch.ones(1, 4), "sequence", 2.0)
    assert w.tolist() == [[2.0] * 4]
    with pytest.raises(ValueError, match="not one of"):
        rollout_is_weights(old, rollout, torch.ones(1, 4), "row", 2.0)


def test_actor_loss_applies_rollout_is_and_always_logs_the_mismatch():
    from megarl.data.batch import Batch
    from megarl.engine.megatron.actor import ActorLossSpec, actor_loss

    lp, old, adv, mask = (t.float() for t in _inputs(8))
    rollout = old - 0.3 * torch.rand(old.shape, generator=torch.Generator().manual_seed(9))
    mb = Batch({"response_mask": mask, "old_log_probs": old, "advantages": adv, "rollout_log_probs": rollout})
    entropy = torch.zeros_like(lp)
    plain_loss, _, plain = actor_loss(
        ActorLossSpec(), lp, entropy, mb.select("response_mask", "old_log_probs", "advantages")
    )
    off_loss, _, off = actor_loss(ActorLossSpec(), lp, entropy, mb)
    assert torch.equal(plain_loss, off_loss) and "rollout/mismatch_kl" not in plain
    assert off["rollout/mismatch_kl"] == pytest.approx(float(((rollout - old) * mask).sum() / mask.sum()), rel=1e-5)
    on_loss, _, on = actor_loss(ActorLossSpec(rollout_is_level="token", rollout_is_threshold=1.2), lp, entropy, mb)
    w, _ = rollout_is_weights(old, rollout, mask, "token", 1.2)
    expected, _ = vanilla_policy_loss(lp, old, adv, mask, PolicyLossConfig(), global_denominator=1.0, weights=w)
    assert on_loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert on_loss.item() != pytest.approx(off_loss.item(), rel=1e-3)
    assert 1.0 < on["rollout_is/mean"] <= 1.2 and 0 < on["rollout_is/clipfrac"] < 1


# ------------------------------------------------------------------ config
TINY = dict(TINY_QWEN3_MOE)


@pytest.mark.parametrize(
    "overrides, key, message",
    [
        (["actor.clip_ratio_c=1.0"], "actor.clip_ratio_c", "must be > 1"),
        (["actor.gspo_clip_ratio_low=1.5"], "actor.gspo_clip_ratio_low", "in [0, 1]"),
        (["actor.cispo_clip_ratio_high=-0.1"], "actor.cispo_clip_ratio_high", ">= 0"),
        (["actor.rollout_is.threshold=0"], "actor.rollout_is.threshold", "must be > 0"),
        (["actor.policy_loss=ppo"], "actor.policy_loss", "must be one of"),
        (["actor.rollout_is.level=row"], "actor.rollout_is.level", "not a valid"),
    ],
)
def test_loss_options_are_validated(overrides, key, message):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, overrides), TINY)
    assert err.value.key == key and message in str(err.value)


def test_loss_options_reach_the_actor_spec():
    from megarl.trainer.runtime import loss_spec

    cfg = validate(
        load_config(
            None,
            [
                "actor.policy_loss=gspo",
                "actor.clip_ratio_c=3",
                "actor.gspo_clip_ratio_high=5e-4",
                "actor.rollout_is.level=sequence",
                "actor.rollout_is.threshold=4",
            ],
        ),
        TINY,
    )
    spec = loss_spec(cfg)
    assert spec.policy_loss == "gspo" and spec.policy.clip_ratio_c == 3.0
    assert spec.policy.gspo_clip_ratio_high == 5e-4 and spec.policy.cispo_clip_ratio_low == 1.0
    assert (spec.rollout_is_level, spec.rollout_is_threshold) == ("sequence", 4.0)
