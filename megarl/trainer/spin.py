"""SPIN's update batch (Chen et al. 2024, arXiv 2401.01335): each prompt's ground-truth response
beside the model's own samples of it.

    batch = spin_update_batch(loop, rows, timing)

The step's generated rows are the rejected side; every prompt adds one chosen row, its prompt
followed by the dataset's answer (the row's `extra_info.response` when the dataset has one, else
`reward_model.ground_truth`) and the end-of-sequence token. The chosen rows get the actor's and
the reference's log-probs here (one call each, 1/rollout.n of the step's rows); the spin loss
(algo/sequence_losses.py) then pairs each group's chosen row with each of its samples. Groups stay
whole and in the rows' order (the trainer balanced whole groups over the data-parallel ranks), the
chosen row first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megarl.data.batch import Batch
from megarl.trainer.step_metrics import timer

if TYPE_CHECKING:
    from megarl.trainer.step_loop import StepLoop

CHOSEN = "chosen"
# what the actor reads of every row under the spin loss (the chosen rows have no rollout columns)
COLUMNS = ("input_ids", "prompt_lengths", "responses", "response_mask", "old_log_probs", "ref_log_probs")


def chosen_text(extra_info, ground_truth: str) -> str:
    """A prompt's chosen response: the dataset's full answer when it has one, else its ground truth."""
    if isinstance(extra_info, dict) and isinstance(extra_info.get("response"), str):
        return extra_info["response"]
    return str(ground_truth)


def group_index(uids) -> torch.Tensor:
    """Dense group ids, in order of first appearance."""
    dense: dict = {}
    return torch.tensor([dense.setdefault(u, len(dense)) for u in uids], dtype=torch.long)


def chosen_rows(rows: Batch, tokenizer) -> Batch:
    """One row per prompt (uid), in order of first appearance: its prompt and chosen response."""
    if tokenizer.eos_token_id is None:
        raise ValueError("spin: the tokenizer has no eos_token_id to end the chosen responses with")
    uids = list(rows["uid"])
    seen: dict = {}
    for i, u in enumerate(uids):
        seen.setdefault(u, i)
    first = list(seen.values())
    prompts, answers = [], []
    for i in first:
        n = int(rows["prompt_lengths"][i])
        prompts.append(rows["input_ids"][i, :n].tolist())
        text = chosen_text(rows["extra_info"][i] if "extra_info" in rows else None, rows["ground_truth"][i])
        answers.append(tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id])
    return _token_rows(prompts, answers, [uids[i] for i in first])


def _token_rows(prompts: list[list[int]], answers: list[list[int]], uids: list) -> Batch:
    import numpy as np

    R = max(len(a) for a in answers)
    T = max(len(p) + len(a) for p, a in zip(prompts, answers))
    return Batch(
        tensors={
            "input_ids": torch.tensor([p + a + [0] * (T - len(p) - len(a)) for p, a in zip(prompts, answers)]),
            "prompt_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.long),
            "responses": torch.tensor([a + [0] * (R - len(a)) for a in answers]),
            "response_mask": torch.tensor([[1.0] * len(a) + [0.0] * (R - len(a)) for a in answers]),
        },
        non_tensors={"uid": np.array(uids, dtype=object)},
    )


def _pad_to(batch: Batch, width: int, length: int) -> Batch:
    """Right-pad the response columns to `width` and input_ids to `length` (zeros)."""
    out = {}
    for k, v in batch.tensors.items():
        if k == "input_ids":
            v = torch.nn.functional.pad(v, (0, length - v.shape[1]))
        elif v.dim() == 2:
            v = torch.nn.functional.pad(v, (0, width - v.shape[1]))
        out[k] = v
    return Batch(out, batch.non_tensors)


def merge(samples: Batch, chosen: Batch) -> Batch:
    """The update batch: per group in the samples' order, its chosen row then its samples, with
    `chosen` (1 / 0) and `group_index`; both sides padded to one width."""
    width = max(samples["responses"].shape[1], chosen["responses"].shape[1])
    length = max(samples["input_ids"].shape[1], chosen["input_ids"].shape[1])
    samples = _pad_to(samples.select(*COLUMNS, "uid"), width, length)
    chosen = _pad_to(chosen.select(*COLUMNS, "uid"), width, length)
    samples[CHOSEN] = torch.zeros(len(samples))
    chosen[CHOSEN] = torch.ones(len(chosen))
    both = Batch.concat([chosen, samples])
    uids = list(both["uid"])
    where = {u: k for k, u in enumerate(dict.fromkeys(list(samples["uid"])))}
    order = sorted(range(len(both)), key=lambda i: (where[uids[i]], -float(both[CHOSEN][i])))
    both = both[torch.tensor(order)]
    both["group_index"] = group_index(both["uid"])
    return both.select(*COLUMNS, CHOSEN, "group_index")


def spin_update_batch(loop: StepLoop, rows: Batch, timing: dict) -> tuple[Batch, dict]:
    """The samples with their prompts' chosen rows (old and ref log-probs computed); metrics."""
    chosen = chosen_rows(rows, loop.rt.tokenizer)
    t = loop.cfg.rollout.temperature
    with timer(timing, "spin_chosen"):
        view = chosen.select("input_ids", "prompt_lengths", "responses", "response_mask")
        chosen = chosen.union(loop.rt.actor.compute_log_prob(view, t).select("old_log_probs"))
        if loop.ref_is_actor:  # refreshed after the last update: the actor's own (phases.old_ref_values)
            chosen["ref_log_probs"] = chosen["old_log_probs"].clone()
        else:
            chosen = chosen.union(loop.rt.actor.compute_ref_log_prob(view, t))
    mask = chosen["response_mask"]
    return merge(rows, chosen), {
        "spin/chosen_length": float(mask.sum(1).mean()),
        "spin/chosen_log_prob": float(((chosen["old_log_probs"] * mask).sum(1)).mean()),
    }
