"""The columns of rows to score, and rows scored but not yet normalised (model.RowScorer)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RowColumns:
    rows: list[int]  # the rows' numbers in the step's batch (named in errors)
    data_sources: list[str]
    prompts: list  # chat messages (a list of {role, content}) or text
    responses: list[str]
    ground_truths: list[str]
    extra_infos: list[dict]
    # the policy's token ids (the classifier reuses them when it shares the policy's tokenizer)
    prompt_ids: list | None = None
    response_ids: list | None = None


@dataclass
class Scored:
    """Rows scored, before normalisation and combination: the rule's scores (None when not run),
    the model's raw scores (None without a model; NaN where it failed) and its failures."""

    rule: np.ndarray | None
    model: np.ndarray | None
    failed: np.ndarray | None

    @staticmethod
    def assemble(n: int, parts: list[tuple[list[int], Scored]]) -> Scored:
        """One Scored of n rows from pieces of them (row indices, piece)."""
        first = parts[0][1]
        out = Scored(
            *(None if a is None else np.zeros(n, dtype=a.dtype) for a in (first.rule, first.model, first.failed))
        )
        for idx, piece in parts:
            for name in ("rule", "model", "failed"):
                if getattr(out, name) is not None:
                    getattr(out, name)[idx] = getattr(piece, name)
        return out
