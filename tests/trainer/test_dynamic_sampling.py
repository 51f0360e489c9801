"""DAPO's pieces: dynamic sampling (keep groups whose responses disagree, generate more until the
batch is full, bounded) and overlong reward shaping, checked by hand on small batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.data.batch import Batch


def _round(k: int, scores: list[list[float]], width: int) -> Batch:
    """A scored generation round: one group per inner list, uids unique per round."""
    uids = [f"r{k}-g{g}" for g, group in enumerate(scores) for _ in group]
    flat = [s for group in scores for s in group]
    n = len(flat)
    return Batch(
        {
            "raw_scores": torch.tensor(flat),
            "responses": torch.full((n, width), 7),
            "response_mask": torch.ones(n, width),
        },
        {"uid": np.array(uids, dtype=object)},
    )


def test_informative_groups_are_the_ones_whose_scores_differ():
    from megarl.trainer.dynamic_sampling import informative_groups

    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 1.0, 0.0])
    uids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert informative_groups(scores, uids).tolist() == [False, False, False, False, False, False, True, True]
    assert not informative_groups(torch.tensor([1.0]), ["solo"]).any()  # a group of one never informs


def test_fill_generates_until_the_batch_is_full_and_keeps_exactly_the_groups_wanted():
    from megarl.trainer.dynamic_sampling import fill_informative

    rounds = [
        [[1, 1], [0, 1], [0, 0]],  # 1 informative group
        [[1, 0], [1, 1], [0, 0]],  # 1 more
        [[0, 1], [1, 0], [1, 1]],
    ]  # 2 more: 4 available, 3 wanted
    calls = []

    def generate(k):
        calls.append(k)
        return _round(k, rounds[k], width=2 + k)  # later rounds have longer responses

    rows, stats = fill_informative(generate, groups_wanted=3, max_rounds=5)
    assert calls == [0, 1, 2]
    assert list(dict.fromkeys(rows["uid"])) == ["r0-g1", "r1-g0", "r2-g0"]
    assert len(rows) == 6 and rows["responses"].shape == (6, 4)  # padded to the widest round
    assert rows["response_mask"][:2, 2:].sum() == 0 and rows["response_mask"][4:].sum() == 8
    assert stats == {
        "rollout/gen_batches": 3.0,
        "rollout/groups_generated": 9.0,
        "rollout/groups_kept_frac": pytest.approx(4 / 9),
        "rollout/groups_padded": 0.0,
    }


def test_fill_gives_up_after_the_bound_and_says_which_knob():
    from megarl.trainer.dynamic_sampling import FilterGroupsError, fill_informative

    with pytest.raises(FilterGroupsError, match="algorithm.filter_groups.max_num_gen_batches"):
        fill_informative(lambda k: _round(k, [[1, 1], [0, 0]], 2), groups_wanted=1, max_rounds=3, pad=False)


def test_when_the_rounds_run_out_the_batch_is_topped_up_with_uninformative_groups():
    from megarl.trainer.dynamic_sampling import fill_informative

    rounds = [[[1, 1], [0, 1]], [[0, 0], [1, 1]]]
    rows, stats = fill_informative(lambda k: _round(k, rounds[k], 2), groups_wanted=3, max_rounds=2)
    # the informative group first, then the spares in generation order
    assert list(dict.fromkeys(rows["uid"])) == ["r0-g1", "r0-g0", "r1-g0"]
    assert stats["rollout/groups_padded"] == 2.0 and stats["rollout/gen_batches"] == 2.0


def test_overlong_penalty_by_hand():
    from megarl.reward.overlong import overlong_penalty

    # limit 10, buffer 4: free up to 6 tokens, then -1/4 per token (x factor 0.5), -0.5 at the limit
    got = overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), 10, 4, 0.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5])
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), 10, 11)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["algorithm.filter_groups.max_num_gen_batches=-1"], "algorithm.filter_groups.max_num_gen_batches"),
        (
            [
                "algorithm.filter_groups.enable=true",
                "rollout.n=1",
                "actor.ppo_mini_batch_size=16",
                "algorithm.adv_estimator=reinforce_plus_plus",
            ],
            "algorithm.filter_groups.enable",
        ),
        (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=3"], "reward.overlong_buffer.len"),
    ],
)
def test_bad_dapo_settings_are_refused_naming_the_key(overrides, key):
    from pathlib import Path

    from megarl.config.loader import ConfigError, load_config
    from megarl.config.validate import validate

    root = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(load_config(root / "configs/quickstart.yaml", overrides))


def test_the_dapo_config_validates():
    from pathlib import Path

    from megarl.config.loader import load_config
    from megarl.config.validate import validate

    root = Path(__file__).resolve().parents[2]
    cfg = validate(load_config(root / "configs/quickstart-dapo.yaml", []))
    assert cfg.algorithm.filter_groups.enable and cfg.reward.overlong_buffer.enable
    assert cfg.actor.clip_ratio_high > cfg.actor.clip_ratio_low
