"""Scoring that overlaps generation (reward.overlap): a generate call's rows are scored in the
scorer's worker threads as their requests finish (model.py's module doc says how it is measured)."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import torch

from megarl.reward.rows import RowColumns, Scored


class OverlapScoring:
    """One generate call's rows, scored as their requests finish (model.py's module doc)."""

    def __init__(self, scorer, prompts, n: int):  # scorer: the model.RowScorer that made it
        self.scorer, self.n = scorer, n
        self.columns = {k: list(prompts[k]) for k in ("data_source", "ground_truth", "extra_info")}
        self.columns["raw_prompt"] = (
            list(prompts["raw_prompt"]) if "raw_prompt" in prompts.non_tensors else [""] * len(prompts)
        )
        self.ids = getattr(scorer.model, "needs_token_ids", False)  # the policy's ids to the model
        if self.ids:
            self.columns["raw_prompt_ids"] = list(prompts["raw_prompt_ids"])
        self.delivered = [False] * len(prompts)
        self.jobs: list[tuple[list[int], list[str], concurrent.futures.Future]] = []

    def on_rows(self, prompt_indices: list[int], outputs: list[list]) -> None:
        """RolloutManager's callback: the n outputs of each of `prompt_indices` are final."""
        c, n = self.columns, self.n
        for i in prompt_indices:
            if self.delivered[i]:
                raise RuntimeError(f"prompt {i}'s rows were delivered twice to the overlap scorer")
            self.delivered[i] = True
        pick = lambda name: [c[name][i] for i in prompt_indices for _ in range(n)]  # noqa: E731
        responses = [out.text for outs in outputs for out in outs]
        ids = (pick("raw_prompt_ids"), [list(out.output_ids) for outs in outputs for out in outs]) if self.ids else ()
        cols = RowColumns(
            [i * n + j for i in prompt_indices for j in range(n)],
            pick("data_source"),
            pick("raw_prompt"),
            responses,
            pick("ground_truth"),
            pick("extra_info"),
            *ids,
        )
        self.jobs.append((cols.rows, responses, self.scorer._pool.submit(self.scorer.score_piece, cols)))

    def collect(self, rows) -> torch.Tensor:
        """Every row's score (waiting for the jobs still running), normalised over the whole batch
        (a training batch); checks each was scored once, on the response the batch holds."""
        with self.scorer._lock:
            self.scorer._generation_end = time.perf_counter()
        missing = [i for i, done in enumerate(self.delivered) if not done]
        if missing:
            raise RuntimeError(f"prompts {missing[:8]} were never delivered to the overlap scorer")
        scored = np.zeros(len(rows), dtype=bool)
        texts, parts = rows["response_text"], []
        for idx, responses, future in self.jobs:
            parts.append((idx, future.result()))  # a RewardError naming the row is raised here
            if [texts[i] for i in idx] != responses:
                raise RuntimeError(f"rows {idx[:4]}...: the overlap scorer scored other responses than the batch holds")
            scored[idx] = True
        if not scored.all():
            raise RuntimeError(f"rows {np.flatnonzero(~scored)[:8].tolist()} were not scored")
        return torch.as_tensor(self.scorer.finish(Scored.assemble(len(rows), parts), train=True))
