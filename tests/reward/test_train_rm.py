"""Bradley-Terry reward-model training (megarl/reward/{train_rm,rm_presets,preference_pairs}.py).

The digits preset is built as a run builds it, then judged independently: its held-out pairs are
made again from the recipe and scored by Hugging Face's own forward in float64, one sequence at a
time; at least 0.9 of them must rank the correct answer first (chance is 0.5).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from megarl.config.validate_reward import check_classifier_head
from megarl.reward.preference_pairs import digits_pairs, prompt_ids
from megarl.reward.rm_presets import PRESETS, build_reward_model
from megarl.reward.rule import digits_score
from megarl.reward.train_rm import RECIPE_FILE, main, split_pairs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def digits_rm(tmp_path_factory):
    return build_reward_model("tiny-digits-rm", tmp_path_factory.mktemp("rm") / "reward_model")


@pytest.mark.slow  # ~30 s on two cores (the preset is trained)
def test_the_digits_reward_model_ranks_held_out_pairs_correctly(digits_rm):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    preset = PRESETS["tiny-digits-rm"]
    model = AutoModelForSequenceClassification.from_pretrained(digits_rm, dtype=torch.float64).eval()
    model.config.pad_token_id = None  # one sequence at a time: its last token is pooled
    tok = AutoTokenizer.from_pretrained(digits_rm)
    pairs = digits_pairs(tok, model.config.vocab_size, preset.num_pairs, preset.train.seed, preset.max_response_tokens)
    _, held_out = split_pairs(pairs, preset.held_out, preset.train.seed)
    with torch.no_grad():
        score = lambda ids: float(model(torch.tensor([ids])).logits[0, 0])  # noqa: E731
        wins = [score(chosen) > score(rejected) for chosen, rejected in held_out]
    accuracy = float(np.mean(wins))
    assert len(held_out) == 205 and accuracy >= 0.9, accuracy
    recorded = json.loads((digits_rm / RECIPE_FILE).read_text())
    assert abs(recorded["held_out_accuracy"] - accuracy) <= 1 / len(held_out)  # its own float32 count
    check_classifier_head(str(digits_rm))  # a folder reward.model.path accepts
    assert build_reward_model("tiny-digits-rm", digits_rm) == digits_rm  # the same recipe: reused, not retrained
    assert (digits_rm / RECIPE_FILE).read_text() == json.dumps(recorded, indent=2)


def test_digits_pairs_prefer_what_the_verifier_scores_right():
    from megarl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    pairs = digits_pairs(tok, 64, 200, seed=3, max_response_tokens=2)
    prompt_len = len(prompt_ids(tok, [{"role": "user", "content": "123"}]))
    for chosen, rejected in pairs:
        digits = tok.decode(chosen[1 : prompt_len - 1])  # "<|user|>382<|assistant|>"
        assert chosen[:prompt_len] == rejected[:prompt_len]  # the same prompt
        for response, want in ((chosen[prompt_len:], 1.0), (rejected[prompt_len:], 0.0)):
            assert 1 <= len(response) <= 2
            assert digits_score(tok.decode(response, skip_special_tokens=True), digits[-1], {}) == want
    # the answer hidden behind a token that decodes to nothing: both kinds are in the pairs
    assert any(c[prompt_len] in (0, 2, 3, 4) or c[prompt_len] >= 51 for c, _ in pairs)


def test_the_command_trains_on_a_pairs_file_and_refuses_bad_arguments(tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"{i}{i + 1}", "chosen": str(i + 1), "rejected": "x"} for i in range(8)]
    rows.append({"prompt": [{"role": "user", "content": "99"}], "chosen": "9", "rejected": "0"})
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rm"
    assert main(["--pairs", str(pairs), "--init", "tiny-llama", "--out", str(out), "--steps", "3"]) == 0
    check_classifier_head(str(out))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    assert "held-out pair accuracy" in capsys.readouterr().out
    pairs.write_text('{"prompt": "1", "chosen": "2"}\n')
    for argv, message in (
        (["--pairs", str(pairs)], r"pairs\.jsonl:1: not a pair \(KeyError"),
        (["--pairs", str(tmp_path / "none.jsonl")], r"--pairs .*none\.jsonl does not exist"),
        (["--task", "digits", "--init", str(tmp_path)], r"is neither a tiny preset .* nor a Hugging Face folder"),
        (["--task", "digits", "--init", "tiny-deepseek-v3"], r"DeepseekV3.* is not a reward model with one score"),
    ):
        assert main([*argv, "--out", str(tmp_path / "x"), "--steps", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("megarl: rm-train error: "), err
        assert re.search(message, err), err
