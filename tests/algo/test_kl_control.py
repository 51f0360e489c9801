"""KL in the reward: the controllers, the penalty, and its config (hand-computed values)."""

import math

import pytest
import torch

from megarl.algo import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    make_kl_controller,
    token_level_scores,
)
from megarl.config import ConfigError, load_config, validate
from megarl.config.validate import resolve
from megarl.models.tiny import TINY_QWEN3_MOE

torch.set_num_threads(1)
TINY = dict(TINY_QWEN3_MOE)


def test_fixed_controller_never_moves():
    ctrl = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        assert ctrl.update(kl, 256) == 0.05
    assert ctrl.value == 0.05


def test_adaptive_controller_hand_computed():
    # value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon, target 1, horizon 100, n 10
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    assert ctrl.update(1.5, 10) == pytest.approx(0.1 * 1.02)  # error 0.5 -> 0.2
    assert ctrl.update(0.9, 10) == pytest.approx(0.1 * 1.02 * 0.99)  # error -0.1
    assert ctrl.update(0.0, 50) == pytest.approx(0.1 * 1.02 * 0.99 * 0.9)  # error -1 -> -0.2, n/h 0.5
    assert ctrl.update(1.0, 10) == pytest.approx(0.1 * 1.02 * 0.99 * 0.9)  # on target: unchanged
    assert ctrl.value == pytest.approx(0.090882)


def test_adaptive_controller_converges_towards_the_target_direction():
    # a KL that stays above target keeps raising the coefficient, by at most 20% * n / horizon
    ctrl = make_kl_controller("adaptive", 0.01, 0.1, 1000)
    values = [ctrl.update(0.5, 100) for _ in range(5)]
    assert values == pytest.approx([0.01 * 1.02**k for k in range(1, 6)])
    assert isinstance(make_kl_controller("fixed", 0.01, 0.1, 1000), FixedKLController)
    with pytest.raises(ValueError, match="not one of"):
        make_kl_controller("pid", 0.01, 0.1, 1000)
    with pytest.raises(ValueError, match="target_kl > 0"):
        AdaptiveKLController(0.01, 0.0, 10)


def test_token_level_scores_sit_on_the_last_response_token():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]])
    out = token_level_scores(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 0, 1.0], [2.0, 0, 0], [0, 0, 0], [0, 4.0, 0]]


@pytest.mark.parametrize(
    "kind, per_token",
    [
        ("k1", math.log(2)),  # log p - log q, p = .5, q = .25
        ("k3", 0.5 + math.log(2) - 1),  # q/p - log(q/p) - 1
    ],
)
def test_apply_kl_penalty_hand_computed(kind, per_token):
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.25, 0.25, 0.25]]))
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    scores = token_level_scores(torch.tensor([1.0, 0.0]), mask)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, 0.1, kind)
    d = 0.1 * per_token
    # row 0: KL [k, 0, k], score 1 on token 2; row 1: KL [k] on its one token, padding untouched
    assert rewards.tolist() == [pytest.approx([-d, 0.0, 1 - d], abs=1e-6), pytest.approx([-d, 0.0, 0.0], abs=1e-6)]
    # row means: 2k/3 and k -> batch mean 5k/6
    assert metrics["kl_reward/kl"] == pytest.approx(5 * per_token / 6, rel=1e-5)
    assert metrics["kl_reward/coef"] == 0.1
    with pytest.raises(ValueError, match="must share a"):
        apply_kl_penalty(scores[:, :2], old, ref, mask, 0.1, kind)


def test_kl_in_reward_config():
    cfg = load_config(
        None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_penalty=k3"]
    )
    assert cfg.algorithm.kl_penalty == "k3" and cfg.algorithm.kl_ctrl.type == "adaptive"
    assert resolve(cfg).ref.enabled is True  # auto: the reward needs ref log-probs
    assert resolve(load_config(None, [])).ref.enabled is False
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, ["algorithm.use_kl_in_reward=true", "ref.enabled=false"]), TINY)
    assert err.value.key == "ref.enabled" and "needs reference log-probs" in str(err.value)
    assert validate(cfg, TINY).ref.enabled is True  # wired into the loop's advantage stage
    for override, key in [
        ("algorithm.kl_ctrl.target_kl=0", "algorithm.kl_ctrl.target_kl"),
        ("algorithm.kl_ctrl.horizon=0", "algorithm.kl_ctrl.horizon"),
        ("algorithm.kl_ctrl.kl_coef=-1", "algorithm.kl_ctrl.kl_coef"),
    ]:
        with pytest.raises(ConfigError) as err:
            validate(load_config(None, [override]), TINY)
        assert err.value.key == key
    with pytest.raises(ConfigError, match="must be one of"):
        load_config(None, ["algorithm.kl_ctrl.type=pid"])
