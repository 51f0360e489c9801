"""Tiny reward models for tests, and Hugging Face's float64 scores of them (the reference)."""

from __future__ import annotations

import functools

import numpy as np
import torch


def save_reward_model(out, preset: str = "tiny-qwen3", seed: int = 0, tokenizer=None) -> str:
    """A random tiny reward model of `preset` saved at `out` (its head scaled up so scores are O(1))."""
    from megarl.reward.train_rm import init_classifier

    model, tok = init_classifier(preset, seed)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    model.save_pretrained(out)
    (tokenizer or tok).save_pretrained(out)
    return str(out)


@functools.cache
def _float64_model(path: str):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float64).eval()
    model.config.pad_token_id = None
    return model


def hf_float64(path: str, sequences) -> np.ndarray:
    """HF's own forward in float64 on CPU, each sequence alone and unpadded: with pad_token_id
    unset HF pools the last token, so nothing of megarl's padding or pooling is involved."""
    model = _float64_model(str(path))
    with torch.no_grad():
        return np.array([float(model(torch.tensor([list(map(int, s))])).logits[0, 0]) for s in sequences])
