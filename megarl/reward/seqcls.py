"""Sequence-classification reward models: loading one, and its score of token sequences.

A reward model here is a Hugging Face `XForSequenceClassification` checkpoint with one label (the
layout of Llama / Qwen2 / Qwen3 / Qwen3-MoE reward models: the decoder, then a `score` linear
from the hidden size to 1). Its score of a sequence is that linear applied to the last token's
final hidden state. HF's own forward finds "the last token" as the last one that is not
pad_token_id, which goes wrong when a policy's response itself contains the pad id (a tiny
character model samples it); here the last token is the row's length - 1, so rows are
right-padded with any id and scored exactly as alone.

The scoring worker (classifier_worker.py) and Bradley-Terry training (train_rm.py) both score
with `sequence_scores`, so a trained model is scored the way it was trained.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megarl.config.validate_reward import CLASSIFIER_ARCHITECTURES


def load_classifier(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The reward model at `path`, in eval mode on `device`. Refuses a checkpoint without the
    one-score head (validate_reward checks the config first; this guards direct callers)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    check_head(model, path)
    return model.to(device).eval()


def check_head(model, where: str) -> None:
    arch = type(model).__name__
    head = getattr(model, "score", None)
    if arch not in CLASSIFIER_ARCHITECTURES or not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        raise ValueError(
            f"{where}: {arch} is not a reward model with one score per sequence (expected one of "
            f"{sorted(CLASSIFIER_ARCHITECTURES)} with num_labels=1)"
        )


def sequence_scores(model, sequences: Sequence[Sequence[int]], batch_size: int) -> torch.Tensor:
    """One score per sequence (float32, in the given order), `batch_size` rows per forward.
    Rows are sorted by length first, so each micro-batch pads to similar lengths. Differentiable
    when called with grad enabled (training)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if any(len(s) == 0 for s in sequences):
        raise ValueError("a reward model cannot score an empty sequence")
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    parts = []
    pad = model.config.pad_token_id or 0  # any id: the positions after a row's end are masked
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = len(sequences[rows[0]])
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, i in enumerate(rows):
            ids[k, : len(sequences[i])] = torch.as_tensor(list(sequences[i]), dtype=torch.long)
            mask[k, : len(sequences[i])] = 1
        ids, mask = ids.to(device), mask.to(device)
        hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(rows), device=device), mask.sum(1) - 1]
        parts.append(model.score(last)[:, 0].float())
    if not parts:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return torch.cat(parts)[torch.as_tensor(order, device=device).argsort()]
