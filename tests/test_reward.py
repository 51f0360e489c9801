"""Rule reward registry, the digits verifier, custom reward functions."""

import sys
import textwrap

import pytest
import torch

from megarl.reward import rule
from megarl.reward import (RewardError, known_data_sources, load_custom_function,
                           make_reward_function, register_scorer, score, score_rows)

torch.set_num_threads(1)


@pytest.mark.parametrize("response, truth, expected", [
    ("7", "7", 1.0),
    ("7x", "7", 1.0),        # the answer is the first len(truth) characters; the rest is ignored
    ("7\n", "7", 1.0),
    ("3", "7", 0.0),
    ("", "7", 0.0),          # an empty response (immediate eos) is wrong, not an error
    (" 7", "7", 0.0),        # position matters: the first character is the answer
    ("73", "72", 0.5),       # multi-character answers earn per-position credit
    ("27", "72", 0.0),
])
def test_digits_score(response, truth, expected):
    assert score("megarl/digits", response, truth, {}) == expected


def test_digits_score_depends_on_the_ground_truth():
    # one fixed answer scores 1 on exactly one of the ten possible answers
    assert [score("megarl/digits", "4", str(d)) for d in range(10)] == [0.0] * 4 + [1.0] + [0.0] * 5


@pytest.mark.parametrize("response,truth,expected", [
    ("23 + 58 = 81.", "81", 1.0),           # the last integer counts
    ("81 is wrong, it is 80", "81", 0.0),
    ("23 - 58 = -35", "-35", 1.0),          # a sign attached to the number
    ("the answer is 1,234", "1234", 1.0),   # thousands separators
    ("no number here", "5", 0.0),
    ("", "5", 0.0),
])
def test_arith_score(response, truth, expected):
    assert score("megarl/arith", response, truth, {}) == expected


def test_unknown_data_source_names_it_and_the_known_ones():
    with pytest.raises(RewardError) as info:
        score("openai/gsm8k", "42", "42")
    message = str(info.value)
    assert "'openai/gsm8k'" in message and "megarl/digits" in message
    assert "megarl/digits" in known_data_sources()


def test_register_scorer_and_range_check(monkeypatch):
    monkeypatch.setattr(rule, "_SCORERS", dict(rule._SCORERS))  # keep the registration local
    @register_scorer("test/half")
    def half(solution_str, ground_truth, extra_info):
        return 0.5 if solution_str == ground_truth else extra_info.get("fallback", 0.0)

    assert score("test/half", "a", "a") == 0.5
    assert score("test/half", "a", "b") == 0.0
    with pytest.raises(RewardError, match=r"scorer for 'test/half' returned 2.0, which is not in \[0, 1\]"):
        score("test/half", "a", "b", {"fallback": 2.0})
    with pytest.raises(RewardError, match="returned 'x', not a number"):
        score("test/half", "a", "b", {"fallback": "x"})
    with pytest.raises(RewardError, match="already has a scorer"):
        register_scorer("test/half")(lambda s, g, e: 0.0)


def test_custom_function_from_module(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(textwrap.dedent("""
        def compute(data_source, solution_str, ground_truth, extra_info):
            return 2.0 * (solution_str == ground_truth) - 1.0  # custom rewards may leave [0, 1]
        not_callable = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = make_reward_function("my_reward:compute")
    assert fn("any/source", "a", "a", None) == 1.0
    assert fn("any/source", "a", "b", {}) == -1.0
    with pytest.raises(RewardError, match="'my_reward' has no function 'missing'"):
        load_custom_function("my_reward:missing")
    with pytest.raises(RewardError, match="has no function 'not_callable'"):
        load_custom_function("my_reward:not_callable")
    sys.modules.pop("my_reward", None)


def test_custom_function_from_file_and_bad_specs(tmp_path):
    path = tmp_path / "rw.py"
    path.write_text("def f(ds, s, g, e):\n    return float('nan') if s == 'nan' else len(s)\n")
    fn = make_reward_function(f"{path}:f")
    assert fn("x", "abc", "", {}) == 3.0
    with pytest.raises(RewardError, match="returned nan, which is not finite"):
        fn("x", "nan", "", {})
    with pytest.raises(RewardError, match="must look like 'package.module:function'"):
        load_custom_function("no_colon")
    with pytest.raises(RewardError, match="cannot import 'no_such_module_xyz'"):
        load_custom_function("no_such_module_xyz:f")
    with pytest.raises(RewardError, match="cannot import"):
        load_custom_function(f"{tmp_path / 'absent.py'}:f")


def test_default_reward_function_is_the_registry_and_score_rows():
    fn = make_reward_function(None)
    assert fn is score
    rewards = score_rows(fn, ["megarl/digits"] * 3, ["1", "2", "9"], ["1", "1", "9"], [{}, None, {}])
    assert rewards == [1.0, 0.0, 1.0]
    with pytest.raises(RewardError, match="different lengths"):
        score_rows(fn, ["megarl/digits"], ["1", "2"], ["1"], [{}])
