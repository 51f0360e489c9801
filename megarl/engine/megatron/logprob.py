"""Log-probabilities and entropy of chosen tokens from vocab-parallel logits.

Each TP rank holds logits for a slice of the vocabulary; reductions over the vocabulary (max,
sum of exp, the chosen token's logit) become all-reduces over the TP group, so no rank ever
materialises the full [tokens, vocab] matrix. Gradients flow through both outputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    """all_reduce(SUM) whose backward passes the gradient through unchanged (each rank's
    contribution enters the sum with coefficient 1, and every rank computes the same loss
    from the reduced value)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _allreduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)


def vocab_parallel_logprob_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int = 0,
    group=None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
):
    """log p(label) and entropy per position for logits sharded on the last dim.

    logits: [..., V_local] (this rank's vocab slice starting at `vocab_start`); labels: [...]
    global token ids. Returns (log_prob [...], entropy [...] or None), log_softmax(logits / T).
    """
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    local_max = logits.detach().max(dim=-1).values
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - local_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _allreduce_sum(exp.sum(dim=-1), group)
    log_z = sum_exp.log()

    v_local = logits.shape[-1]
    in_slice = (labels >= vocab_start) & (labels < vocab_start + v_local)
    local_idx = (labels - vocab_start).clamp(0, v_local - 1)
    chosen = shifted.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1) * in_slice
    chosen = _allreduce_sum(chosen, group)
    log_prob = chosen - log_z

    entropy = None
    if with_entropy and not entropy_grad:  # a metric only: no graph through [tokens, vocab]
        with torch.no_grad():
            entropy = log_z - _allreduce_sum((exp * shifted).sum(dim=-1), group) / sum_exp
    elif with_entropy:
        # H = log Z - sum_v p_v * shifted_v
        p_shifted = _allreduce_sum((exp * shifted).sum(dim=-1), group) / sum_exp
        entropy = log_z - p_shifted
    return log_prob, entropy
