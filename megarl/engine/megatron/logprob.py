"""Log-probabilities and entropy of chosen tokens over a vocab-parallel output, in chunks of tokens.

Each TP rank holds a slice of the vocabulary; reductions over the vocabulary (max, sum of exp,
the chosen token's logit, sum of p * logit) become all-reduces over the TP group, so no rank ever
materialises the full vocabulary. The softmax's fp32 intermediates exist for one chunk of tokens
at a time: forward keeps only per-token statistics (max, normaliser, entropy), and backward
recomputes each chunk's probabilities from them.

Two sources of a chunk's logits: given logits [N, V_local] (`vocab_parallel_logprob_entropy`),
or the output layer itself (`fused_linear_logprob_entropy`): hidden [N, h] @ weight[V_local, h]^T
one chunk at a time, where each chunk's d/d logits goes straight into d hidden and d weight.
Backward needs each chunk's logits again (the loss's gradient is not known in forward); two ways
to have them:

- recompute (least memory): make them again in backward, one more GEMM over [tokens x vocab x
  hidden] than the unfused layer runs. No logits for more than one chunk exist: for a 152k
  vocabulary that is the difference between several fp32 [tokens, vocab] tensors per micro-batch
  and a few [chunk, vocab] ones (benchmarks/bench_logprob.py).
- keep_logits: forward writes each chunk's GEMM into one [tokens, vocab_local] tensor in the
  model's dtype (the bytes the plain output layer would have held, none of the softmax's fp32
  intermediates) and backward reads it: three GEMMs, as unfused. The same GEMM on the same chunk
  as recompute, so both give the same bits. Only where a gradient is wanted: a pass without one
  (no_grad, or no input requiring grad) keeps nothing.

`keeps_logits` is the policy behind the actor's `logits_memory: auto`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# fp32 bytes of one [chunk, vocab_local] work buffer; two exist per call, reused by every chunk
# (fresh ones per chunk cost page faults on CPU). Large enough that the per-chunk loop, its
# all-reduces and each op's thread start-up cost little next to the passes over the chunk.
CHUNK_BYTES = 128 * 2**20


# Kept logits per micro-batch (tokens x vocab_local x the model dtype's bytes) up to which
# logits_memory "auto" keeps them: 2 GiB is 7k tokens of a 152k vocabulary in bf16 at TP=1 (3.5k
# in fp32), where the unfused head held 18 bytes per entry (20 GiB at 8k tokens in bf16).
KEEP_LOGITS_BYTES = 2 * 2**30
LOGITS_MEMORY = ("auto", "keep", "recompute")


def chunk_tokens(vocab_local: int) -> int:
    """Tokens per chunk for this rank's vocabulary slice."""
    return max(1, CHUNK_BYTES // (4 * vocab_local))


def keeps_logits(logits_memory: str, tokens: int, vocab_local: int, dtype: torch.dtype) -> bool:
    """Whether a micro-batch of `tokens` keeps its logits for backward: logits_memory "keep",
    "recompute", or "auto" (keep while they fit KEEP_LOGITS_BYTES)."""
    if logits_memory not in LOGITS_MEMORY:
        raise ValueError(f"logits_memory={logits_memory!r}: must be one of {', '.join(LOGITS_MEMORY)}")
    if logits_memory == "auto":
        return tokens * vocab_local * dtype.itemsize <= KEEP_LOGITS_BYTES
    return logits_memory == "keep"


def _chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of ceil(n / chunk) chunks of near-equal size: no short last chunk, whose GEMM
    could take a BLAS path that sums the vocabulary less accurately (seen on CPU: 1e-5 vs 1e-6
    of d hidden's largest entry at one or two rows against 152k)."""
    size = -(-n // -(-n // chunk)) if n else 1
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _tp_active(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def _label_index(labels: torch.Tensor, vocab_start: int, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into this rank's slice [n, 1], whether the label is in the slice [n])."""
    in_slice = (labels >= vocab_start) & (labels < vocab_start + v_local)
    return (labels - vocab_start).clamp(0, v_local - 1).unsqueeze(-1), in_slice


def _scaled(logits: torch.Tensor, buf: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T in fp32: the logits themselves when that is what they are (read, never
    written), else in buf."""
    if logits.dtype == torch.float32 and temperature == 1.0:
        return logits
    buf.copy_(logits)
    return buf.div_(temperature) if temperature != 1.0 else buf


class _GivenLogits:
    """Logits [N, V_local] that exist whole (any float dtype); their gradient is the output."""

    def __init__(self, tensors, o: _Options):
        (self.logits,) = tensors
        self.overwrite = o.overwrite
        self.n, self.v_local = self.logits.shape
        self.in_place = False  # backward's d/d logits need a work buffer of their own

    def for_backward(self) -> tuple:
        return (self.logits,)

    def scaled(self, buf: torch.Tensor, s: int, e: int, temperature: float) -> torch.Tensor:
        return _scaled(self.logits[s:e], buf, temperature)

    def begin_backward(self, needs) -> None:
        # the logits are dead once their gradient exists (a linear layer's backward needs its
        # input, not its output): overwriting them saves a [tokens, vocab] buffer
        self.grad = self.logits if self.overwrite else torch.empty_like(self.logits)

    def add_grad(self, g: torch.Tensor, s: int, e: int) -> None:
        self.grad[s:e] = g

    def grads(self) -> tuple:
        return (self.grad,)


class _OutputLayer:
    """logits = hidden [N, h] @ weight [V_local, h]^T, made one chunk at a time in the model's
    precision (a bf16 GEMM, then fp32, as the output layer and the head did apart). d weight
    sums over chunks in fp32: one rounding to the weight's dtype at the end, as one GEMM.

    keep_logits: forward makes the chunks into `kept` [N, V_local] (the model's dtype), and
    backward, handed (hidden, weight, kept), reads them there instead of making them again. A
    chunk's kept rows are dead once read, so backward works in them: fp32 ones hold d/d logits
    (`in_place`: one fp32 work buffer fewer), bf16 ones its rounding for the GEMMs."""

    def __init__(self, tensors, o: _Options):
        self.hidden, self.weight, *kept = tensors
        self.n, self.v_local = self.hidden.shape[0], self.weight.shape[0]
        self.fp32 = self.hidden.dtype == torch.float32
        self._low = None  # [chunk, V_local] in the model's dtype, when that is not fp32
        self.made = bool(kept)  # backward of a keep_logits pass: the logits exist
        self.kept = kept[0] if kept else None
        self.in_place = self.made and self.fp32
        if o.keep_logits and not kept:
            self.kept = torch.empty(self.n, self.v_local, dtype=self.hidden.dtype, device=self.hidden.device)

    def for_backward(self) -> tuple:
        return (self.hidden, self.weight) + (() if self.kept is None else (self.kept,))

    def _low_buf(self, rows: int) -> torch.Tensor:
        if self._low is None or self._low.shape[0] < rows:
            self._low = torch.empty(rows, self.v_local, dtype=self.hidden.dtype, device=self.hidden.device)
        return self._low[:rows]

    def scaled(self, buf: torch.Tensor, s: int, e: int, temperature: float) -> torch.Tensor:
        if self.in_place:
            return self.kept[s:e].div_(temperature) if temperature != 1.0 else self.kept[s:e]
        if self.made:
            return _scaled(self.kept[s:e], buf, temperature)
        if self.kept is not None:  # into the kept rows: the same GEMM, the same bits, as into buf
            return _scaled(torch.mm(self.hidden[s:e], self.weight.t(), out=self.kept[s:e]), buf, temperature)
        if self.fp32:
            torch.mm(self.hidden[s:e], self.weight.t(), out=buf)
        else:
            buf.copy_(torch.mm(self.hidden[s:e], self.weight.t(), out=self._low_buf(e - s)))
        return buf.div_(temperature) if temperature != 1.0 else buf

    def begin_backward(self, needs) -> None:
        need_hidden, need_weight = needs
        self.d_hidden = torch.empty_like(self.hidden) if need_hidden else None
        self.d_weight = None
        if need_weight:
            self.d_weight = torch.zeros(self.weight.shape, dtype=torch.float32, device=self.weight.device)

    def add_grad(self, g: torch.Tensor, s: int, e: int) -> None:
        if not self.fp32:
            g = (self.kept[s:e] if self.made else self._low_buf(e - s)).copy_(g)
        if self.d_hidden is not None:  # this rank's vocabulary's share; the TP all-reduce is the caller's
            torch.mm(g, self.weight, out=self.d_hidden[s:e])
        if self.d_weight is not None:
            if self.fp32:
                self.d_weight.addmm_(g.t(), self.hidden[s:e])
            else:
                self.d_weight.add_(torch.mm(g.t(), self.hidden[s:e]))

    def grads(self) -> tuple:
        d_weight = None if self.d_weight is None else self.d_weight.to(self.weight.dtype)
        return self.d_hidden, d_weight


@dataclass(frozen=True)
class _Options:
    vocab_start: int = 0
    group: object = None
    temperature: float = 1.0
    chunk: int = 0
    with_entropy: bool = True
    overwrite: bool = False  # _GivenLogits: d/d logits into the logits' storage
    keep_logits: bool = False  # _OutputLayer: the logits kept from forward for backward

    def __post_init__(self):
        if self.temperature == 0.0:  # greedy sampling: scored as sampled at T = 1
            object.__setattr__(self, "temperature", 1.0)


class _ChunkedLogProb(torch.autograd.Function):
    """(log p(label), entropy) per token of a vocab-parallel output whose logits `source` makes.

    Gradients: d log p / d x_v = 1[v = label] - p_v and d H / d x_v = -p_v (log p_v + H), both
    local to a rank's slice once max and normaliser are global, so backward needs no collective.
    Every TP rank receives the same output gradients (each computes the same loss from the
    reduced values)."""

    @staticmethod
    def forward(ctx, source, labels, o: _Options, *tensors):
        src = source(tensors, o)
        n, v_local, device, chunks = src.n, src.v_local, labels.device, _chunks(src.n, o.chunk)
        tp = _tp_active(o.group)
        # log p(label), entropy, and the softmax's max and normaliser (what backward rebuilds p from)
        log_prob, entropy, row_max, sum_exp = (torch.empty(n, dtype=torch.float32, device=device) for _ in range(4))
        work = torch.empty(2, chunks[0][1] if chunks else 0, v_local, dtype=torch.float32, device=device)
        for s, e in chunks:
            scaled = src.scaled(work[0, : e - s], s, e, o.temperature)
            m = torch.amax(scaled, dim=-1)
            if tp:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=o.group)
            x = torch.sub(scaled, m.unsqueeze(-1), out=work[0, : e - s])
            ex = torch.exp(x, out=work[1, : e - s])
            idx, in_slice = _label_index(labels[s:e], o.vocab_start, v_local)
            sums = [ex.sum(dim=-1), x.gather(-1, idx).squeeze(-1) * in_slice]
            if o.with_entropy:
                sums.append(ex.mul_(x).sum(dim=-1))
            stacked = torch.stack(sums)
            if tp:  # one collective for the chunk's sums
                dist.all_reduce(stacked, group=o.group)
            log_z = stacked[0].log()
            log_prob[s:e] = stacked[1] - log_z
            if o.with_entropy:
                entropy[s:e] = log_z - stacked[2] / stacked[0]
            row_max[s:e], sum_exp[s:e] = m, stacked[0]
        ctx.save_for_backward(labels, entropy, row_max, sum_exp, *src.for_backward())
        ctx.meta = (source, o)
        ctx.set_materialize_grads(False)
        return log_prob, (entropy if o.with_entropy else None)

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        labels, entropy, row_max, sum_exp, *tensors = ctx.saved_tensors
        source, o = ctx.meta
        src = source(tensors, o)
        src.begin_backward(ctx.needs_input_grad[3:])
        v_local, chunks, temperature = src.v_local, _chunks(src.n, o.chunk), o.temperature
        # work[0]: d/d logits, unless the source's own rows hold them; work[-1]: p
        rows, buffers = chunks[0][1] if chunks else 0, 1 if src.in_place else 2
        work = torch.empty(buffers, rows, v_local, dtype=torch.float32, device=labels.device)
        for s, e in chunks:
            g = src.scaled(work[0, : e - s], s, e, temperature)
            g = torch.sub(g, row_max[s:e].unsqueeze(-1), out=g if src.in_place else work[0, : e - s])
            g.sub_(sum_exp[s:e].log().unsqueeze(-1))  # log p; shifted first, as forward, keeps the low bits
            p = torch.exp(g, out=work[-1, : e - s])
            if grad_entropy is not None:  # g = -g_H p (log p + H)
                g.add_(entropy[s:e].unsqueeze(-1)).mul_(p).mul_(-grad_entropy[s:e].unsqueeze(-1))
            else:
                g.zero_()
            if grad_log_prob is not None:  # g += g_lp (onehot - p)
                g_lp = grad_log_prob[s:e].unsqueeze(-1)
                g.addcmul_(p, g_lp, value=-1.0)
                idx, in_slice = _label_index(labels[s:e], o.vocab_start, v_local)
                g.scatter_add_(-1, idx, g_lp * in_slice.unsqueeze(-1).to(g.dtype))
            if temperature != 1.0:
                g.div_(temperature)
            src.add_grad(g, s, e)
        return (None,) * 3 + src.grads()


def _apply(source, tensors, labels, lead, entropy_grad: bool, options: _Options):
    log_prob, entropy = _ChunkedLogProb.apply(source, labels.reshape(-1), options, *tensors)
    if entropy is not None:
        entropy = (entropy if entropy_grad else entropy.detach()).reshape(lead)
    return log_prob.reshape(lead), entropy


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
    chunk: at most this many tokens per chunk, the tokens split evenly (default:
    chunk_tokens(V_local)); every TP rank must pass the same.
    overwrite_logits: backward writes d/d logits into the logits' own storage (for logits nothing
    else reads after the loss, as a model's output; a second backward through them is then wrong).
    """
    lead, v_local = logits.shape[:-1], logits.shape[-1]
    options = _Options(vocab_start, group, temperature, chunk or chunk_tokens(v_local), with_entropy, overwrite_logits)
    return _apply(_GivenLogits, (logits.reshape(-1, v_local),), labels, lead, entropy_grad, options)


def fused_linear_logprob_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, keep_logits: bool = False, **kw
):
    """vocab_parallel_logprob_entropy (the same keywords but overwrite_logits) of logits =
    hidden @ weight^T, without those logits.

    hidden: [..., h] (the final norm's output, the same on every TP rank); weight: [V_local, h],
    this rank's vocab slice of the output layer. Gradients reach both; d hidden is this rank's
    share (sum it over TP, as a column-parallel linear's input gradient is). keep_logits: hold
    the logits [tokens, V_local] in hidden's dtype from forward to backward instead of making
    them again there (one GEMM fewer, the same numbers); ignored where no gradient is wanted.
    Backward works in the kept logits, so a retained graph's second backward is refused."""
    entropy_grad = kw.pop("entropy_grad", True)
    kw["chunk"] = kw.get("chunk") or chunk_tokens(weight.shape[0])
    # needs_input_grad says True under no_grad too: whether backward can run is decided here
    kw["keep_logits"] = keep_logits and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    tensors = (hidden.reshape(-1, hidden.shape[-1]), weight)
    return _apply(_OutputLayer, tensors, labels, hidden.shape[:-1], entropy_grad, _Options(**kw))
