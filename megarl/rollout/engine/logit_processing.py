"""SGLang's per-request logit processors, applied to a decode step's logits before sampling.

Order: repetition penalty (multiplicative), frequency and presence penalties (additive), the
min_new_tokens mask, then logit_bias, as SGLang's sampler applies them. Penalties count the
tokens generated so far (never the prompt), as SGLang's penalizers do. The log-probs a request
gets back are those of the processed logits (SGLang reports the same), so they equal megarl's
contract, log_softmax(logits / T) of the model's logits, exactly when no processor is active;
rows with default parameters are never touched, so the default path stays bit-identical.

Token extras (top-k log-probs, chosen tokens' log-probs, entropy) are read from the same
distribution the sampled token's log-prob comes from.
"""

from __future__ import annotations

import torch

from megarl.rollout.engine.protocol import GenerationRequest, SamplingParams, TokenStep, distribution_logprobs


def process_logits(
    logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]], eos_token_ids: frozenset[int]
) -> torch.Tensor:
    """(rows, vocab) logits -> processed logits; the same tensor when no row changes its logits."""
    changing = [i for i, p in enumerate(params) if p.changes_logits]
    if not changing:
        return logits
    processed = logits.clone()
    bias_only = []  # rows whose only active processor is logit_bias: one scatter-add for all of them
    for i in changing:
        if _only_logit_bias(params[i], outputs[i]):
            bias_only.append(i)
        else:
            processed[i] = _process_row(processed[i], params[i], outputs[i], eos_token_ids)
    if any(params[i].logit_bias for i in bias_only):
        rows = [i for i in bias_only for _ in params[i].logit_bias]
        ids = [t for i in bias_only for t, _ in params[i].logit_bias]
        bias = [b for i in bias_only for _, b in params[i].logit_bias]
        device = processed.device
        processed.index_put_(
            (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(ids, dtype=torch.long, device=device)),
            torch.tensor(bias, dtype=processed.dtype, device=device),
            accumulate=True,
        )
    return processed


def _only_logit_bias(p: SamplingParams, output: list[int]) -> bool:
    return not _penalised(p, output) and len(output) >= p.min_new_tokens


def _penalised(p: SamplingParams, output: list[int]) -> bool:
    """Repetition / frequency / presence penalties apply (they count generated tokens only)."""
    return bool(output) and bool(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty)


def _process_row(row: torch.Tensor, p: SamplingParams, output: list[int], eos_token_ids: frozenset[int]):
    vocab = row.shape[0]
    if _penalised(p, output):
        counts = torch.bincount(torch.tensor(output, device=row.device), minlength=vocab)[:vocab].to(row.dtype)
        seen = counts > 0
        if p.repetition_penalty != 1.0:
            scaled = torch.where(row < 0, row * p.repetition_penalty, row / p.repetition_penalty)
            row = torch.where(seen, scaled, row)
        row = row - p.frequency_penalty * counts - p.presence_penalty * seen.to(row.dtype)
    if len(output) < p.min_new_tokens:
        # SGLang masks every stop and EOS token (even with ignore_eos) until min_new_tokens exist.
        stops = [t for t in p.stop_token_ids | eos_token_ids if 0 <= t < vocab]
        if stops:
            row = row.index_fill(0, torch.tensor(stops, device=row.device), float("-inf"))
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=row.device)
        row = row.index_add(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype, device=row.device))
    return row


def token_steps(
    logits: torch.Tensor,
    requests: list[GenerationRequest],
    tokens: list[int],
    logprobs: list[float],
    weight_version: str | None = None,
) -> list[TokenStep]:
    """One TokenStep per row; top-k, requested ids and entropy only for rows that asked;
    `weight_version`: the weights that computed `logits`."""
    extras = [k for k, r in enumerate(requests) if r.wants_token_extras]
    details = {}
    if extras:
        full = distribution_logprobs(logits[extras], [requests[k].params.temperature for k in extras])
        details = {k: _details(full[j], requests[k]) for j, k in enumerate(extras)}
    return [
        TokenStep(t, lp, *details.get(k, (None, None, None)), weight_version=weight_version)
        for k, (t, lp) in enumerate(zip(tokens, logprobs))
    ]


def _details(logprobs: torch.Tensor, req: GenerationRequest):
    top = ids = entropy = None
    if req.return_logprob and req.top_logprobs_num:
        top = top_logprobs(logprobs[None], req.top_logprobs_num)[0]
    if req.return_logprob and req.token_ids_logprob:
        ids = chosen_logprobs(logprobs[None], req.token_ids_logprob)[0]
    if req.return_entropy:
        probs = logprobs.exp()
        entropy = -torch.where(probs > 0, probs * logprobs, 0.0).sum().item()
    return top, ids, entropy


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """(positions, vocab) -> per position the k best (log-prob, token id), best first."""
    values, indices = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), indices.tolist())]


def chosen_logprobs(logprobs: torch.Tensor, token_ids: tuple[int, ...]) -> list[list[tuple[float, int]]]:
    """(positions, vocab) -> per position (log-prob, token id) for each requested id, in order."""
    values = logprobs[:, list(token_ids)].tolist()
    return [list(zip(v, token_ids)) for v in values]
