"""What the embedded engine takes and gives: sampling parameters, requests, results, errors,
and the pure per-row sampling function (no threads, no model)."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field

import torch


class InvalidRequest(ValueError):
    """The request itself is wrong (HTTP 400); the message names the offending field."""


class WeightsUnavailable(RuntimeError):
    """Generation was asked for while the weights are released or not yet refilled."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False  # as in SGLang: also ignores stop_token_ids, not stop strings
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None  # rows with the same seed draw the same samples


def sample_next_tokens(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
                       top_ks: list[int], generators: list[torch.Generator]):
    """Per-row temperature / top-k / top-p sampling of (rows, vocab) logits.

    Returns (token ids, log-probs by the contract: full-vocab log_softmax(logits / T), raw logits
    for T == 0, which picks the argmax). Sampling is an exponential race over the kept tokens
    (argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i / sum of kept p), so each row
    draws from its own generator and a seeded row is reproducible whatever batch it lands in.
    """
    rows, vocab = logits.shape
    temps = torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)
    greedy = temps == 0
    logprobs = torch.log_softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
    probs = logprobs.exp()
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    top_k = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device)[:, None]
    top_p = torch.tensor(top_ps, dtype=logits.dtype, device=logits.device)[:, None]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # the most likely token always stays
    keep_sorted = (torch.arange(vocab, device=logits.device)[None] < top_k) & (mass_before < top_p)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    noise = torch.stack([torch.empty(vocab).exponential_(generator=g) for g in generators]).to(logits.device)
    sampled = torch.where(keep, probs / noise, -1.0).argmax(-1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


@dataclass
class GenerationRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    group_rid: str | None = None  # the caller's rid when n>1 expanded it into several requests
    created: float = field(default_factory=time.time)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class GenerationResult:
    rid: str
    text: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float] | None
    input_logprobs: list[float | None] | None  # from logprob_start_len; the first token has None
    finish_reason: dict
    prompt_tokens: int
    weight_version: str
    e2e_latency: float
