"""Reward models megarl builds in code (reward.model.preset), as the tiny policy presets are built.

`tiny-digits-rm`: tiny-qwen3 (the character tokenizer the quickstart's policy uses, so the
classifier reuses the policy's token ids) with a one-score head, trained Bradley-Terry for 800 steps
on 4096 digits pairs (preference_pairs.digits_pairs: correct answers over wrong ones for the same
prompt, and ties between equally right or wrong responses; 2 response tokens as
configs/quickstart.yaml samples them), 10% held out. Its held-out pair accuracy is in
megarl_rm.json (tests/reward/test_train_rm.py asserts >= 0.9). About a minute on two idle CPU cores.
The same model as

    python -m megarl.reward.train_rm --task digits --out DIR

A preset is built into the run's RUN_DIR/reward_model on first use and reused while its recipe
(megarl_rm.json's) is unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megarl.config.validate_reward import REWARD_MODEL_PRESETS
from megarl.reward.train_rm import RECIPE_FILE, TrainSpec, init_classifier, split_pairs, train_and_save


@dataclass(frozen=True)
class RewardModelPreset:
    init: str  # a tiny policy preset: the decoder and tokenizer the head goes on
    task: str  # the procedural task the pairs come from
    num_pairs: int
    held_out: float
    max_response_tokens: int
    train: TrainSpec = field(default_factory=TrainSpec)


PRESETS = {"tiny-digits-rm": RewardModelPreset("tiny-qwen3", "digits", 4096, 0.1, 2)}
assert tuple(PRESETS) == REWARD_MODEL_PRESETS, "config/validate_reward.py lists the presets validation accepts"


def build_reward_model(name: str, out: str | Path, log: Callable[[str], None] | None = None) -> Path:
    """The preset `name` as a Hugging Face folder at `out`: trained now, or the one already there
    when it was built from the same recipe."""
    from megarl.reward.preference_pairs import digits_pairs

    preset, out = PRESETS[name], Path(out)
    recipe = {"preset": name, **asdict(preset)}
    marker = out / RECIPE_FILE
    if marker.exists() and json.loads(marker.read_text()).get("recipe") == recipe:
        return out
    spec = preset.train
    model, tokenizer = init_classifier(preset.init, spec.seed)
    pairs = digits_pairs(tokenizer, model.config.vocab_size, preset.num_pairs, spec.seed, preset.max_response_tokens)
    info = train_and_save(model, tokenizer, *split_pairs(pairs, preset.held_out, spec.seed), spec, out, recipe)
    if log is not None:
        log(f"built reward model {name} at {out}: held-out pair accuracy {info['held_out_accuracy']:.3f}")
    return out
