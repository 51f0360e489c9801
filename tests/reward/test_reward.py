"""The reward registry, the digits verifier, custom reward functions."""

import sys
import textwrap

import pytest
import torch

from megarl.reward import (
    RewardError,
    known_data_sources,
    load_custom_function,
    make_reward_function,
    register_scorer,
    registry,
    score,
    score_rows,
)

torch.set_num_threads(1)


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("7", "7", 1.0),
        ("7x", "7", 1.0),  # the answer is the first len(truth) characters; the rest is ignored
        ("7\n", "7", 1.0),
        ("3", "7", 0.0),
        ("", "7", 0.0),  # an empty response (immediate eos) is wrong, not an error
        (" 7", "7", 0.0),  # position matters: the first character is the answer
        ("73", "72", 0.5),  # multi-character answers earn per-position credit
        ("27", "72", 0.0),
    ],
)
def test_digits_score(response, truth, expected):
    assert score("megarl/digits", response, truth, {}) == expected


def test_digits_score_depends_on_the_ground_truth():
    # one fixed answer scores 1 on exactly one of the ten possible answers
    assert [score("megarl/digits", "4", str(d)) for d in range(10)] == [0.0] * 4 + [1.0] + [0.0] * 5


@pytest.mark.parametrize(
    "response,truth,expected",
    [
        ("23 + 58 = 81.", "81", 1.0),  # the last integer counts
        ("81 is wrong, it is 80", "81", 0.0),
        ("23 - 58 = -35", "-35", 1.0),  # a sign attached to the number
        ("the answer is 1,234", "1234", 1.0),  # thousands separators
        ("no number here", "5", 0.0),
        ("", "5", 0.0),
    ],
)
def test_arith_score(response, truth, expected):
    assert score("megarl/arith", response, truth, {}) == expected


def test_unknown_data_source_names_it_and_the_known_ones():
    with pytest.raises(RewardError) as info:
        score("nobody/knows", "42", "42")
    message = str(info.value)
    assert "'nobody/knows'" in message and "megarl/digits" in message
    assert "megarl/digits" in known_data_sources()


def test_register_scorer_and_range_check(monkeypatch):
    monkeypatch.setattr(registry, "_SCORERS", dict(registry._SCORERS))  # keep the registration local

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
    (tmp_path / "my_reward.py").write_text(
        textwrap.dedent("""
        def compute(data_source, solution_str, ground_truth, extra_info):
            return 2.0 * (solution_str == ground_truth) - 1.0  # custom rewards may leave [0, 1]
        not_callable = 3
    """)
    )
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


# ------------------------------------------------------------------ errors name the row
def test_a_reward_that_raises_or_returns_a_non_number_names_the_row(monkeypatch):
    monkeypatch.setattr(registry, "_SCORERS", dict(registry._SCORERS))

    @register_scorer("test/raises")
    def raises(solution_str, ground_truth, extra_info):
        raise ZeroDivisionError("division by zero")

    fn = make_reward_function(None)
    with pytest.raises(
        RewardError,
        match=r"row 1 \(data_source 'test/raises', ground_truth '7'\): "
        r"the reward raised ZeroDivisionError: division by zero",
    ):
        score_rows(fn, ["megarl/digits", "test/raises"], ["7", "7"], ["7", "7"], [{}, {}])
    with pytest.raises(
        RewardError,
        match=r"row 0 \(data_source 'x/y', ground_truth '1'\): the reward "
        r"function returned 'oops', not a number",
    ):
        score_rows(lambda d, s, g, e: "oops", ["x/y"], ["1"], ["1"], [{}])
    with pytest.raises(RewardError, match=r"row 2 \(data_source 'megarl/digits', .*\): .*empty ground_truth"):
        score_rows(fn, ["megarl/digits"] * 3, ["1", "1", "1"], ["1", "1", ""], [{}] * 3)


# ------------------------------------------------------------------ math (math-verify)
from megarl.reward import math as math_reward  # noqa: E402
from megarl.reward import take_counts  # noqa: E402

PATHOLOGICAL = "The answer is \\boxed{9^{9^{9^{9}}}}"  # sympy evaluates the tower for minutes


@pytest.fixture(scope="module", autouse=True)
def _math_defaults_after_this_module():
    yield
    math_reward.configure(timeout_s=math_reward.DEFAULT_TIMEOUT_S, max_workers=4)


@pytest.fixture
def math_limits():
    math_reward.configure(timeout_s=30.0, max_workers=4)  # generous: the machine may be loaded
    take_counts()
    return math_reward.configure


@pytest.mark.parametrize(
    "data_source, response, truth, expected",
    [
        ("math", "So the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
        ("math", "The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # LaTeX fraction vs decimal
        ("math", "So the result is 0.5", "\\frac{1}{2}", 1.0),  # plain final answer
        ("math", "\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
        ("math", "$\\sqrt{2}/2$", "\\frac{\\sqrt{2}}{2}", 1.0),
        ("math", "The final answer is $\\boxed{x^2+2x+1}$", "(x+1)^2", 1.0),  # symbolic equality
        ("math", "The answer is 1,000", "1000", 1.0),
        ("math", "\\boxed{3}", "4", 0.0),  # wrong
        ("math", "I think 5, no wait, 7", "5", 0.0),  # the last answer counts
        ("math", "\\boxed{3}", "\\boxed{3}", 1.0),  # a boxed ground truth
        ("lighteval/MATH", "\\boxed{\\frac{2}{4}}", "\\frac12", 1.0),  # verl's aliases
        ("HuggingFaceH4/MATH-500", "\\boxed{2}", "3", 0.0),
        ("aime2024", "The answer is \\boxed{204}", "204", 1.0),
        ("numina_olympiads", "\\boxed{-1}", "-1", 1.0),
        ("openai/gsm8k", "She has 9 eggs left. #### 18", "16 - 3 - 4 = <<16-3-4=9>>9 ... #### 18", 1.0),
        ("openai/gsm8k", "so 9 eggs\n#### 9", "#### 18", 0.0),
        ("openai/gsm8k", "#### 1,000", "1000", 1.0),  # commas in the answer
        ("openai/gsm8k", "The total is \\boxed{18}", "18", 1.0),  # no ####: math-verify's answer
    ],
)
def test_math_verifier_table(math_limits, data_source, response, truth, expected):
    assert score(data_source, response, truth, {}) == expected
    assert take_counts()["reward/timeouts"] == 0


def test_unparsable_answers_score_zero_and_are_counted(math_limits):
    assert score("math", "I do not know.", "4") == 0.0
    assert score("math", "", "4") == 0.0
    counts = take_counts()
    assert counts["reward/unparsable"] == 2 and counts["reward/timeouts"] == 0
    assert take_counts()["reward/unparsable"] == 0  # taking resets


def test_time_limit_from_a_thread_scores_zero_counts_and_recovers(math_limits):
    import threading
    import time

    math_limits(timeout_s=3.0, max_workers=2)
    assert score("math", "\\boxed{1}", "1") == 1.0  # the worker is started (not timed)
    out: list = []
    started = time.perf_counter()
    worker = threading.Thread(target=lambda: out.append(score("math", PATHOLOGICAL, "1")))
    worker.start()
    worker.join(timeout=60)
    elapsed = time.perf_counter() - started
    assert out == [0.0] and elapsed < 30  # killed at 3 s (+ slack on a loaded machine), not minutes
    assert take_counts()["reward/timeouts"] == 1
    assert score("math", "\\boxed{2}", "2") == 1.0  # a fresh worker judges the next one


def test_threads_share_the_verifier_pool(math_limits):
    from concurrent.futures import ThreadPoolExecutor

    math_limits(max_workers=2)
    cases = [(f"\\boxed{{{i}}}", str(i if i % 3 else i + 1)) for i in range(24)]
    with ThreadPoolExecutor(4) as pool:
        scores = list(pool.map(lambda c: score("math", *c), cases))
    assert scores == [0.0 if i % 3 == 0 else 1.0 for i in range(24)]
    assert math_reward.verifier()._running == 0 and len(math_reward.verifier()._idle) <= 2


def _pathological_in_child(timeout_s: float) -> tuple[float, float, float]:
    from megarl.reward import math as child_math
    from megarl.reward import score as child_score
    from megarl.reward import take_counts as child_counts

    child_math.configure(timeout_s=timeout_s)
    return (
        child_score("math", PATHOLOGICAL, "1"),
        child_counts()["reward/timeouts"],
        child_score("math", "\\boxed{2}", "2"),
    )


def test_time_limit_in_a_daemonic_subprocess():
    """A multiprocessing pool's workers are daemonic and may not start multiprocessing children;
    the verifier's workers are plain subprocesses, so the limit holds there too."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_pathological_in_child, (3.0,)) == (0.0, 1.0, 1.0)


def test_math_options_reach_the_verifier(math_limits):
    make_reward_function(None, math_timeout_s=2.5, math_workers=3)
    assert (math_reward.verifier().timeout_s, math_reward.verifier().max_workers) == (2.5, 3)


# ---------------------------------------------------------------- the contract every registered reward keeps
FAMILY_MEMBER = {"aime*": "aime24", "numina_*": "numina_math", "reasoning_gym/*": "reasoning_gym/basic_arithmetic"}


def contract_cases() -> dict:
    """data_source -> (a right response, ground truth, extra_info), from megarl's own task rows
    where it has them, else a math answer."""
    from megarl.data.tasks import make_arith_rows, make_arith_tool_rows, make_digits_rows, make_reasoning_gym_rows
    from megarl.data.visual_task import make_shapes_rows

    cases = {}
    for row in (
        make_digits_rows(1, seed=3)
        + make_arith_rows(1, seed=3)
        + make_arith_tool_rows(1, seed=3)
        + make_reasoning_gym_rows("basic_arithmetic", 1, seed=3)
        + make_shapes_rows(1, seed=3)
    ):
        truth = row["reward_model"]["ground_truth"]
        right = f"<answer>{truth}</answer>" if row["data_source"].startswith("reasoning_gym/") else truth
        cases[row["data_source"]] = (right, truth, row["extra_info"])
    math_case = ("so the answer is \\boxed{\\frac{3}{4}}", "0.75", {})
    for source in (
        "math",
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
        "math_dapo",
        "math_dapo_reasoning",
        "aime24",
        "numina_math",
    ):
        cases[source] = math_case
    cases["openai/gsm8k"] = ("3 + 4 = 7 apples\n#### 7", "7", {})
    return cases


def test_every_registered_reward_keeps_the_contract(math_limits):
    """Every data source (a family by one member) is covered, scores its right answer 1 and a wrong,
    an empty and a garbage response a finite number in [0, 1), the same each time: a new
    registration without a case here fails this test."""
    import math

    cases = contract_cases()
    for key in known_data_sources():
        source = FAMILY_MEMBER.get(key, key)
        assert source in cases, f"registered data source {key!r} has no contract case"
        right, truth, extra = cases[source]
        assert score(source, right, truth, extra) == 1.0, source
        for wrong in ("", "zz qq \\boxed{", "<answer>-987654</answer> #### -987654 \\boxed{-987654}"):
            first, second = score(source, wrong, truth, extra), score(source, wrong, truth, extra)
            assert math.isfinite(first) and 0.0 <= first < 1.0 and first == second, (source, wrong, first)
