"""The classifier reward (reward.model.kind=classifier): a sequence-classification reward model
scored by a Ray worker group, the driver's side.

What is scored is the prompt and the response as the policy saw them. When the reward model's
tokenizer is the policy's (the same vocabulary, special tokens and chat template), the policy's own
token ids are sent: the prompt as rendered for the policy and the response tokens as sampled (its
stop token included). Otherwise the response ids are decoded with the policy's tokenizer and the
conversation (the prompt's chat messages, then the response as the assistant's turn) is encoded
with the reward model's tokenizer and chat template (`chat_ids`; plain prompt + response text when
it has none). Training pairs given as text (train_rm.py --pairs) are encoded the same way.

Rows go to the group's ranks balanced by tokens; each rank scores its rows `reward.model.batch_size`
at a time, sorted by length and right-padded (seqcls.sequence_scores). A row longer than the
model's max_position_embeddings, or a score that is not finite, is a Failure of that row (the scorer
raises or falls back per reward.model.on_failure); a rank that dies fails the step (WorkerError).
Scores come back raw: the scorer normalises them (normalize.py) over the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megarl.data.balance import partition_micro_batches
from megarl.reward.remote import Failure


@dataclass
class ClassifierWorkers:
    """The reward model's running worker group and what the driver needs to know of it."""

    group: Any  # RayWorkerGroup of classifier_worker.RewardModelWorker
    path: str  # the reward model's HF folder (its tokenizer)
    max_length: int  # its max_position_embeddings


def same_tokenizer(a, b) -> bool:
    """Whether token ids of `a` mean the same to `b`, conversations included."""
    return (
        a.get_vocab() == b.get_vocab()
        and list(a.all_special_tokens) == list(b.all_special_tokens)
        and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
    )


def chat_ids(tokenizer, messages: list[dict], response: str) -> list[int]:
    """A conversation (`messages`, then `response` as the assistant's turn) as the reward model's
    tokens: its chat template when it has one, else the prompt's text followed by the response."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    prompt = "\n".join(str(m.get("content", "")) for m in messages)
    return tokenizer.encode(prompt + response)


class ClassifierReward:
    """RowScorer's model for kind=classifier. Thread-safe: the worker group orders concurrent calls."""

    kind = "classifier"
    needs_token_ids = True  # RowScorer adds prompt_ids / response_ids to each row

    def __init__(self, workers: ClassifierWorkers, policy_tokenizer=None):
        from transformers import AutoTokenizer

        self.group, self.max_length = workers.group, workers.max_length
        self.tokenizer = AutoTokenizer.from_pretrained(workers.path)
        self.policy_tokenizer = policy_tokenizer
        self.reuse_ids = policy_tokenizer is not None and same_tokenizer(policy_tokenizer, self.tokenizer)

    def sequence(self, row: dict) -> list[int]:
        """The tokens the reward model scores for one row (the module doc)."""
        if self.reuse_ids:
            assert row.get("prompt_ids") is not None, "the scorer hands the policy's ids to a same-tokenizer model"
            return [*map(int, row["prompt_ids"]), *map(int, row["response_ids"])]
        response = row["response"]
        if self.policy_tokenizer is not None and row.get("response_ids") is not None:
            response = self.policy_tokenizer.decode(list(row["response_ids"]), skip_special_tokens=True)
        return chat_ids(self.tokenizer, row["messages"], response)

    def score(self, rows: list[dict]) -> list[float | Failure]:
        """One raw score or Failure per row, in order."""
        sequences = [self.sequence(r) for r in rows]
        out: list[float | Failure | None] = [None] * len(rows)
        fits = []
        for i, s in enumerate(sequences):
            if 0 < len(s) <= self.max_length:
                fits.append(i)
            else:
                out[i] = Failure(
                    f"{len(s)} tokens; the reward model scores 1 to {self.max_length} (its max_position_embeddings)"
                )
        world = self.group.world_size
        parts = partition_micro_batches([len(sequences[i]) for i in fits], min(world, len(fits))) if fits else []
        parts = [[fits[k] for k in p] for p in parts] + [[] for _ in range(world - len(parts))]
        for part, values in zip(parts, self.group.score_sequences([[sequences[i] for i in p] for p in parts])):
            for i, value in zip(part, values):
                out[i] = value if math.isfinite(value) else Failure(f"the reward model scored it {value}")
        return out  # type: ignore[return-value]

    def take_stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """The worker group belongs to the run's runtime, which shuts it down."""
