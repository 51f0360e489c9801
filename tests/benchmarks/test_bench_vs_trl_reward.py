"""benchmarks/_trl_grpo.py re-implements the digits reward (megarl is not importable in the TRL
venv); it must score every response exactly as megarl's rule scorer. Needs only megarl's .venv:
the module imports nothing but the standard library at load time."""

import importlib.util
from pathlib import Path

import pytest

from megarl.data.tasks import make_digits_rows
from megarl.reward.rule import RewardError, digits_score

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "_trl_grpo.py"


def _trl_module():
    spec = importlib.util.spec_from_file_location("_trl_grpo", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RESPONSES = ["", "2", "27", "72", "x2", " 2", "2\n", "22", "0", "9999", "\n4", ".3", "abc", "é2", "382", "38"]
GOLDS = ["2", "0", "4", "9", "382", "38", "é"]


def test_trl_digits_score_equals_megarl():
    trl = _trl_module()
    for gold in GOLDS:
        for text in RESPONSES:
            assert trl.digits_score(text, gold) == digits_score(text, gold, {}), (text, gold)


def test_trl_digits_score_on_task_rows():
    trl = _trl_module()
    for row in make_digits_rows(64, seed=0):
        gold = row["reward_model"]["ground_truth"]
        for text in (gold, gold + "7", row["extra_info"]["digits"], "", "5"):
            assert trl.digits_score(text, gold) == digits_score(text, gold, {})


def test_trl_digits_score_refuses_empty_answer():
    trl = _trl_module()
    with pytest.raises(RewardError):
        digits_score("1", "", {})
    with pytest.raises(ValueError):
        trl.digits_score("1", "")


def test_trl_completion_text_reads_conversational_and_plain():
    trl = _trl_module()
    assert trl.completion_text([{"role": "assistant", "content": "7"}]) == "7"
    assert trl.completion_text("7") == "7"
