"""RewardModelWorker: one rank of the classifier reward model's worker group.

Each rank holds the whole reward model (on its device: the GPU Ray gave it, else the CPU) and
scores the rows the driver hands it; ranks share nothing, so the group is pure data parallel and
needs no process group. The trainer places the group (trainer/reward_workers.py): a sliver of each
actor device (colocated, like the critic) or a pool of its own (reward.model.placement).
"""

from __future__ import annotations

import torch

from megarl.controller.decorator import register
from megarl.controller.dispatch import Dispatch
from megarl.controller.worker import Worker


class RewardModelWorker(Worker):
    def __init__(self, path: str, batch_size: int, dtype: str = "auto", **dist):
        super().__init__(**dist)
        self.path, self.batch_size, self.dtype = path, batch_size, dtype
        self.model = None

    def init_distributed(self) -> None:
        """Load the model (the group calls this on every rank at once); no process group: ranks
        score independently."""
        from megarl.reward.seqcls import load_classifier

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            dtype = torch.bfloat16 if device == "cuda" else torch.float32
        else:
            dtype = getattr(torch, self.dtype)
        self.model = load_classifier(self.path, dtype, device)

    @register(dispatch=Dispatch.ALL_TO_ALL)
    def score_sequences(self, sequences: list[list[int]]) -> list[float]:
        """One raw score per token sequence (prompt + response), in order."""
        from megarl.reward.seqcls import sequence_scores

        if not sequences:
            return []
        with torch.inference_mode():
            return sequence_scores(self.model, sequences, self.batch_size).cpu().tolist()

    @register(dispatch=Dispatch.RANK_ZERO)
    def max_length(self) -> int:
        """The longest sequence the model takes (its max_position_embeddings)."""
        return int(self.model.config.max_position_embeddings)
