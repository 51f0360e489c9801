"""Log-probabilities and entropy of chosen tokens from vocab-parallel logits, in chunks of tokens.

Each TP rank holds logits for a slice of the vocabulary; reductions over the vocabulary (max,
sum of exp, the chosen token's logit, sum of p * logit) become all-reduces over the TP group, so
no rank ever materialises the full vocabulary. The softmax's fp32 intermediates exist for one
chunk of tokens at a time: forward keeps only per-token statistics (max, normaliser, entropy),
and backward recomputes each chunk's probabilities from them to write d/d logits. For a 152k
vocabulary that is the difference between several fp32 [tokens, vocab] tensors per micro-batch
and a few [chunk, vocab] ones (benchmarks/bench_logprob.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# fp32 bytes of one [chunk, vocab_local] intermediate; a few of these live at once. Large enough
# that the per-chunk loop and all-reduces cost nothing next to the exp over the chunk.
CHUNK_BYTES = 64 * 2**20


def chunk_tokens(vocab_local: int) -> int:
    """Tokens per chunk for this rank's vocabulary slice."""
    return max(1, CHUNK_BYTES // (4 * vocab_local))


def _tp_active(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.float()
    return x / temperature if temperature != 1.0 else x


class _ChunkedLogProb(torch.autograd.Function):
    """(log p(label), entropy) per token of 2-D vocab-parallel logits [N, V_local].

    Gradients: d log p / d x_v = 1[v = label] - p_v and d H / d x_v = -p_v (log p_v + H), both
    local to a rank's slice once max and normaliser are global, so backward needs no collective.
    Every TP rank receives the same output gradients (each computes the same loss from the
    reduced values)."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group, temperature, chunk, with_entropy):
        n, v_local = logits.shape
        tp = _tp_active(group)
        log_prob = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n, dtype=torch.float32, device=logits.device) if with_entropy else None
        row_max = torch.empty_like(log_prob)
        sum_exp = torch.empty_like(log_prob)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            x = _scaled(logits[s:e], temperature)
            m = x.max(dim=-1).values
            if tp:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            x = x - m.unsqueeze(-1)
            ex = x.exp()
            lab = labels[s:e]
            in_slice = (lab >= vocab_start) & (lab < vocab_start + v_local)
            idx = (lab - vocab_start).clamp(0, v_local - 1)
            sums = [ex.sum(dim=-1), x.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * in_slice]
            if with_entropy:
                sums.append((ex * x).sum(dim=-1))
            stacked = torch.stack(sums)
            if tp:  # one collective for the chunk's three sums
                dist.all_reduce(stacked, group=group)
            log_z = stacked[0].log()
            log_prob[s:e] = stacked[1] - log_z
            if with_entropy:
                entropy[s:e] = log_z - stacked[2] / stacked[0]
            row_max[s:e], sum_exp[s:e] = m, stacked[0]
        ctx.save_for_backward(logits, labels, row_max, sum_exp, entropy if with_entropy else None)
        ctx.meta = (vocab_start, temperature, chunk)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            return log_prob, None
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, labels, row_max, sum_exp, entropy = ctx.saved_tensors
        vocab_start, temperature, chunk = ctx.meta
        n, v_local = logits.shape
        grad = torch.empty_like(logits)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            # shifted first, as forward: subtracting max + log Z at once loses the low bits
            log_p = (_scaled(logits[s:e], temperature) - row_max[s:e].unsqueeze(-1)) - sum_exp[s:e].log().unsqueeze(-1)
            p = log_p.exp()
            g = torch.zeros_like(p)
            if grad_entropy is not None:
                g -= grad_entropy[s:e].unsqueeze(-1) * p * (log_p + entropy[s:e].unsqueeze(-1))
            if grad_log_prob is not None:
                g_lp = grad_log_prob[s:e].unsqueeze(-1)
                g -= g_lp * p
                lab = labels[s:e]
                in_slice = (lab >= vocab_start) & (lab < vocab_start + v_local)
                idx = (lab - vocab_start).clamp(0, v_local - 1).unsqueeze(-1)
                g.scatter_add_(-1, idx, g_lp * in_slice.unsqueeze(-1).to(g.dtype))
            grad[s:e] = g / temperature if temperature != 1.0 else g
        return grad, None, None, None, None, None, None


def vocab_parallel_logprob_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int = 0,
    group=None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    chunk: int | None = None,
):
    """log p(label) and entropy per position for logits sharded on the last dim.

    logits: [..., V_local] (this rank's vocab slice starting at `vocab_start`, any float dtype);
    labels: [...] global token ids. Returns (log_prob [...], entropy [...] or None), of
    log_softmax(logits / T) in fp32. entropy_grad=False: the entropy is a metric (detached).
    chunk: tokens per chunk (default: chunk_tokens(V_local)); every TP rank must pass the same.
    """
    lead, v_local = logits.shape[:-1], logits.shape[-1]
    if temperature == 0.0:  # greedy sampling: scored as sampled at T = 1
        temperature = 1.0
    chunk = chunk or chunk_tokens(v_local)
    log_prob, entropy = _ChunkedLogProb.apply(
        logits.reshape(-1, v_local), labels.reshape(-1), vocab_start, group, temperature, chunk, with_entropy
    )
    if entropy is not None:
        entropy = (entropy if entropy_grad else entropy.detach()).reshape(lead)
    return log_prob.reshape(lead), entropy
