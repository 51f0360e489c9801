"""ReMax's baseline (arXiv 2310.10505): one greedy response per prompt, scored like the samples.

    baseline = greedy_baselines(rows, generate, score)   # (len(rows),): the row's prompt's greedy score

The step's sampled rows are grouped by `uid` (one per prompt; with dynamic sampling the rows of a
step come from several prompt batches, and after a pad some prompts appear twice: each uid is
generated once). The greedy rollout costs one extra generation of the step's prompts with n=1 and
temperature 0, logged as perf/gen_baseline_s; its tokens are scored, never trained on.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from megarl.data.batch import Batch
from megarl.rollout.client.manager import GENERATED_NON_TENSORS


def prompt_rows(rows: Batch) -> tuple[Batch, np.ndarray]:
    """One row per distinct uid (the first occurrence, its prompt columns only) and, for every row
    of `rows`, the index of its uid among them. Prompt columns: every non-tensor column the rollout
    did not add (it repeats the prompt batch's onto each of the prompt's rows)."""
    uids = list(rows["uid"])
    first: dict = {}
    for i, u in enumerate(uids):
        first.setdefault(u, i)
    order = list(first.values())
    prompts = rows.select(*[k for k in rows.non_tensors if k not in GENERATED_NON_TENSORS])[order]
    where = {u: k for k, u in enumerate(first)}
    return prompts, np.asarray([where[u] for u in uids], dtype=np.int64)


def greedy_baselines(
    rows: Batch, generate: Callable[[Batch], Batch], score: Callable[[Batch], torch.Tensor]
) -> tuple[torch.Tensor, dict]:
    """`generate(prompts)`: the greedy responses (n=1) of those prompts, in order; `score(rows)`:
    their scores (the same reward as the samples, overlong shaping included). Returns each row's
    baseline score and metrics."""
    prompts, index = prompt_rows(rows)
    greedy = generate(prompts)
    if len(greedy) != len(prompts):
        raise RuntimeError(f"remax: the greedy rollout returned {len(greedy)} rows for {len(prompts)} prompts")
    baseline = score(greedy).to(torch.float32)
    per_row = baseline[torch.as_tensor(index)]
    return per_row, {
        "remax/baseline_mean": float(baseline.mean()),
        "remax/greedy_length_mean": float(greedy["response_mask"].sum(1).float().mean()),
        "remax/beats_baseline_frac": float((rows["scores"] > per_row).float().mean()),
    }


def remax_baseline(loop, step: int, rows: Batch, timing: dict) -> tuple[torch.Tensor, dict]:
    """The loop's greedy rollout of the step's prompts and its scores (`loop`: the Trainer)."""
    from dataclasses import replace

    from megarl.trainer.step_metrics import timer

    base = loop.sampling(step, train=False)  # seeds (seed, step, 2): neither training's nor validation's
    greedy = replace(base, n=1, temperature=0.0, seed=base.seed and (loop.cfg.trainer.seed, step, 2))

    def generate(prompts: Batch) -> Batch:
        with timer(timing, "gen_baseline"), loop._watching_ranks():
            return loop.rt.rollout.generate(prompts, greedy, loop._served_version())

    def score(out: Batch) -> torch.Tensor:
        with timer(timing, "reward"):
            return loop._score(out, train=False) + loop._overlong_penalty(out)

    return greedy_baselines(rows, generate, score)
