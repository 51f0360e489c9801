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

# fp32 bytes of one [chunk, vocab_local] work buffer; two exist per call, reused by every chunk
# (fresh ones per chunk cost page faults on CPU). Large enough that the per-chunk loop, its
# all-reduces and each op's thread start-up cost little next to the passes over the chunk.
CHUNK_BYTES = 128 * 2**20


def chunk_tokens(vocab_local: int) -> int:
    """Tokens per chunk for this rank's vocabulary slice."""
    return max(1, CHUNK_BYTES // (4 * vocab_local))


def _tp_active(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def _label_index(labels: torch.Tensor, vocab_start: int, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into this rank's slice [n, 1], whether the label is in the slice [n])."""
    in_slice = (labels >= vocab_start) & (labels < vocab_start + v_local)
    return (labels - vocab_start).clamp(0, v_local - 1).unsqueeze(-1), in_slice


def _scaled(buf: torch.Tensor, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T in fp32: the logits themselves when that is what they are, else written into buf."""
    if logits.dtype == torch.float32 and temperature == 1.0:
        return logits
    buf.copy_(logits)
    return buf.div_(temperature) if temperature != 1.0 else buf


class _ChunkedLogProb(torch.autograd.Function):
    """(log p(label), entropy) per token of 2-D vocab-parallel logits [N, V_local].

    Gradients: d log p / d x_v = 1[v = label] - p_v and d H / d x_v = -p_v (log p_v + H), both
    local to a rank's slice once max and normaliser are global, so backward needs no collective.
    Every TP rank receives the same output gradients (each computes the same loss from the
    reduced values)."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group, temperature, chunk, with_entropy, overwrite):
        n, v_local = logits.shape
        tp = _tp_active(group)
        # log p(label), entropy, and the softmax's max and normaliser (what backward rebuilds p from)
        log_prob, entropy, row_max, sum_exp = (
            torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(4)
        )
        work = torch.empty(2, min(chunk, n), v_local, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            scaled = _scaled(work[0, : e - s], logits[s:e], temperature)
            m = torch.amax(scaled, dim=-1)
            if tp:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            x = torch.sub(scaled, m.unsqueeze(-1), out=work[0, : e - s])
            ex = torch.exp(x, out=work[1, : e - s])
            idx, in_slice = _label_index(labels[s:e], vocab_start, v_local)
            sums = [ex.sum(dim=-1), x.gather(-1, idx).squeeze(-1) * in_slice]
            if with_entropy:
                sums.append(ex.mul_(x).sum(dim=-1))
            stacked = torch.stack(sums)
            if tp:  # one collective for the chunk's sums
                dist.all_reduce(stacked, group=group)
            log_z = stacked[0].log()
            log_prob[s:e] = stacked[1] - log_z
            if with_entropy:
                entropy[s:e] = log_z - stacked[2] / stacked[0]
            row_max[s:e], sum_exp[s:e] = m, stacked[0]
        ctx.save_for_backward(logits, labels, entropy, row_max, sum_exp)
        ctx.meta = (vocab_start, temperature, chunk, overwrite)
        ctx.set_materialize_grads(False)
        return log_prob, (entropy if with_entropy else None)

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, labels, entropy, row_max, sum_exp = ctx.saved_tensors
        vocab_start, temperature, chunk, overwrite = ctx.meta
        n, v_local = logits.shape
        # the logits are dead once their gradient exists (a linear layer's backward needs its input,
        # not its output): overwriting them saves a [tokens, vocab] buffer
        grad = logits if overwrite else torch.empty_like(logits)
        work = torch.empty(2, min(chunk, n), v_local, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            g = _scaled(work[0, : e - s], logits[s:e], temperature)
            g = torch.sub(g, row_max[s:e].unsqueeze(-1), out=work[0, : e - s])
            g.sub_(sum_exp[s:e].log().unsqueeze(-1))  # log p; shifted first, as forward, keeps the low bits
            p = torch.exp(g, out=work[1, : e - s])
            if grad_entropy is not None:  # g = -g_H p (log p + H)
                g.add_(entropy[s:e].unsqueeze(-1)).mul_(p).mul_(-grad_entropy[s:e].unsqueeze(-1))
            else:
                g.zero_()
            if grad_log_prob is not None:  # g += g_lp (onehot - p)
                g_lp = grad_log_prob[s:e].unsqueeze(-1)
                g.addcmul_(p, g_lp, value=-1.0)
                idx, in_slice = _label_index(labels[s:e], vocab_start, v_local)
                g.scatter_add_(-1, idx, g_lp * in_slice.unsqueeze(-1).to(g.dtype))
            if temperature != 1.0:
                g.div_(temperature)
            grad[s:e] = g
        return grad, None, None, None, None, None, None, None


def vocab_parallel_logprob_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int = 0,
    group=None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    chunk: int | None = None,
    overwrite_logits: bool = False,
):
    """log p(label) and entropy per position for logits sharded on the last dim.

    logits: [..., V_local] (this rank's vocab slice starting at `vocab_start`, any float dtype);
    labels: [...] global token ids. Returns (log_prob [...], entropy [...] or None), of
    log_softmax(logits / T) in fp32. entropy_grad=False: the entropy is a metric (detached).
    chunk: tokens per chunk (default: chunk_tokens(V_local)); every TP rank must pass the same.
    overwrite_logits: backward writes d/d logits into the logits' own storage (for logits nothing
    else reads after the loss, as a model's output; a second backward through them is then wrong).
    """
    lead, v_local = logits.shape[:-1], logits.shape[-1]
    if temperature == 0.0:  # greedy sampling: scored as sampled at T = 1
        temperature = 1.0
    chunk = chunk or chunk_tokens(v_local)
    log_prob, entropy = _ChunkedLogProb.apply(
        logits.reshape(-1, v_local),
        labels.reshape(-1),
        vocab_start,
        group,
        temperature,
        chunk,
        with_entropy,
        overwrite_logits,
    )
    if entropy is not None:
        entropy = (entropy if entropy_grad else entropy.detach()).reshape(lead)
    return log_prob.reshape(lead), entropy
