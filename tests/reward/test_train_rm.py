"""Bradley-Terry reward-model training (megarl/reward/{train_rm,rm_presets,preference_pairs}.py).

The digits preset is built as a run builds it, then judged independently: its held-out pairs are
made again from the recipe and scored by Hugging Face's own forward in float64, one sequence at a
time; at least 0.9 of them, and of those whose chosen answer is correct, must rank the chosen
response first (chance is 0.5).
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


@pytest.mark.slow  # about a minute on two cores: the preset is trained
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
        preferences = [(chosen, rejected) for chosen, rejected, wins in held_out if wins == 1.0]
        ties = [(first, second) for first, second, wins in held_out if wins == 0.5]
        accuracy = float(np.mean([score(chosen) > score(rejected) for chosen, rejected in preferences]))
        tie_gaps = [abs(score(first) - score(second)) for first, second in ties]
        gaps = [abs(score(chosen) - score(rejected)) for chosen, rejected in preferences]
    assert len(held_out) == 410 and len(preferences) > 250 and accuracy >= 0.9, accuracy
    # a tie's two responses score alike: far closer than a preference's
    assert np.median(tie_gaps) < 0.25 * np.median(gaps), (np.median(tie_gaps), np.median(gaps))
    recorded = json.loads((digits_rm / RECIPE_FILE).read_text())
    assert abs(recorded["held_out_accuracy"] - accuracy) <= 1 / len(held_out)  # its own float32 count
    check_classifier_head(str(digits_rm))  # a folder reward.model.path accepts
    assert build_reward_model("tiny-digits-rm", digits_rm) == digits_rm  # the same recipe: reused, not retrained
    assert (digits_rm / RECIPE_FILE).read_text() == json.dumps(recorded, indent=2)


def test_digits_pairs_rank_responses_as_the_verifier_does():
    from megarl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    pairs = digits_pairs(tok, 64, 400, seed=3, max_response_tokens=2)
    prompt_len = len(prompt_ids(tok, [{"role": "user", "content": "123"}]))
    for first, second, wins in pairs:
        digits = tok.decode(first[1 : prompt_len - 1])  # "<|user|>382<|assistant|>"
        assert first[:prompt_len] == second[:prompt_len]  # the same prompt
        assert all(1 <= len(ids) - prompt_len <= 2 for ids in (first, second))
        scores = [
            digits_score(tok.decode(ids[prompt_len:], skip_special_tokens=True), digits[-1], {})
            for ids in (first, second)
        ]
        # a preference: the right answer over a wrong one; a tie: equally right or wrong
        assert scores == [1.0, 0.0] if wins == 1.0 else (wins == 0.5 and scores[0] == scores[1]), (scores, wins)
    ties = [p for p in pairs if p[2] == 0.5]
    assert 0 < len(ties) < len(pairs) / 2 and {p[0] == p[1] for p in ties} != {True}
    # the answer hidden behind a token that decodes to nothing; pairs that differ only in the answer
    assert any(c[prompt_len] in (0, 2, 3, 4) or c[prompt_len] >= 51 for c, _, _ in pairs)
    assert any(len(c) == len(r) and sum(a != b for a, b in zip(c, r)) == 1 for c, r, w in pairs if w == 1.0)


def test_a_tie_is_half_a_win_each_way():
    from megarl.reward.seqcls import sequence_scores
    from megarl.reward.train_rm import bradley_terry_loss, init_classifier

    model, _ = init_classifier("tiny-qwen3", 0)
    a, b = [2, 10, 3, 7], [2, 11, 3, 8, 1]
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))  # scores apart
        d = float(sequence_scores(model, [a], 1)[0] - sequence_scores(model, [b], 1)[0])
        tie = float(bradley_terry_loss(model, [(a, b, 0.5)], 2))
        win = float(bradley_terry_loss(model, [(a, b, 1.0)], 2))
    log_sigmoid = lambda x: -np.log1p(np.exp(-x))  # noqa: E731
    assert abs(d) > 0.5 and win == pytest.approx(-log_sigmoid(d), abs=1e-5)
    assert tie == pytest.approx(-0.5 * log_sigmoid(d) - 0.5 * log_sigmoid(-d), abs=1e-5)


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
