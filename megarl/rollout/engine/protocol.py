"""What the embedded engine takes and gives: sampling parameters, requests, results, errors,
and the pure per-row sampling function (no threads, no model)."""

from __future__ import annotations

import concurrent.futures
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
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
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max
    frequency_penalty: float = 0.0  # logit -= penalty * count in the output so far
    presence_penalty: float = 0.0  # logit -= penalty if the token is in the output so far
    repetition_penalty: float = 1.0  # output tokens: positive logits / penalty, negative * penalty
    min_new_tokens: int = 0  # stop and EOS tokens are masked until this many tokens exist
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    stop_regex: tuple[re.Pattern, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False  # as in SGLang: also ignores stop_token_ids, not stop strings
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None  # rows with the same seed draw the same samples
    stream_interval: int = 1  # streamed responses: one event per this many tokens

    @property
    def changes_logits(self) -> bool:
        """Whether penalties, bias or min_new_tokens move this row's logits away from the model's."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.min_new_tokens
            or self.logit_bias
        )


def distribution_logprobs(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """megarl's log-prob contract: full-vocab log_softmax(logits / T); raw logits for T == 0."""
    temps = torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)
    return torch.log_softmax(logits / torch.where(temps == 0, 1.0, temps)[:, None], dim=-1)


def sample_next_tokens(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ps: list[float],
    top_ks: list[int],
    generators: list[torch.Generator],
    min_ps: list[float] | None = None,
):
    """Per-row temperature / top-k / top-p / min-p sampling of (rows, vocab) logits.

    Returns (token ids, log-probs by `distribution_logprobs`; T == 0 picks the argmax). Sampling
    is an exponential race over the kept tokens (argmax p_i / E_i with E_i ~ Exp(1) draws i with
    probability p_i / sum of kept p), so each row draws from its own generator and a seeded row is
    reproducible whatever batch it lands in. Every row draws one noise vector per call, whatever
    its parameters, so adding min_p or other options never shifts another row's random stream.
    """
    rows, vocab = logits.shape
    greedy = torch.tensor(temperatures, device=logits.device) == 0
    logprobs = distribution_logprobs(logits, temperatures)
    probs = logprobs.exp()
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    top_k = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device)[:, None]
    top_p = torch.tensor(top_ps, dtype=logits.dtype, device=logits.device)[:, None]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # the most likely token always stays
    keep_sorted = (torch.arange(vocab, device=logits.device)[None] < top_k) & (mass_before < top_p)
    if min_ps is not None and any(m > 0 for m in min_ps):
        min_p = torch.tensor(min_ps, dtype=logits.dtype, device=logits.device)[:, None]
        keep_sorted &= sorted_probs >= min_p * sorted_probs[:, :1]
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    noise = _exponential_noise(rows, vocab, generators).to(logits.device)
    sampled = torch.where(keep, probs / noise, -1.0).argmax(-1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def _exponential_noise(rows: int, vocab: int, generators: list[torch.Generator]) -> torch.Tensor:
    """Row r's Exp(1) vector from generators[r]. Consecutive rows that share a generator (every
    unseeded row shares the engine's) are drawn in one call: the same numbers, in the same order,
    as one draw per row (tests/rollout/server/test_rollout_server.py checks the bits), without 256 small ops."""
    noise = torch.empty(rows, vocab)
    start = 0
    for k in range(1, rows + 1):
        if k == rows or generators[k] is not generators[start]:
            noise[start:k].exponential_(generator=generators[start])
            start = k
    return noise


@dataclass(frozen=True)
class TokenStep:
    """One generated token and what the request asked to know about it (streamed as it happens)."""

    token: int
    logprob: float
    top_logprobs: list[tuple[float, int]] | None = None  # best first
    token_ids_logprobs: list[tuple[float, int]] | None = None  # in the requested order
    entropy: float | None = None
    weight_version: str | None = None  # the engine's weight_version at the forward step that produced it


@dataclass
class GenerationRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0  # with return_logprob: the k most likely tokens at each position
    token_ids_logprob: tuple[int, ...] | None = None  # with return_logprob: these tokens' log-probs
    return_entropy: bool = False
    return_routed_experts: bool = False  # SGLang's field: the MoE experts of every token (megarl/wire/routing.py)
    routed_experts_start_len: int = 0  # the first token whose experts are returned
    group_rid: str | None = None  # the caller's rid when n>1 expanded it into several requests
    # a vision-language model's prompt images (engine/vision.py PromptImages, from
    # GenerationEngine.attach_images); input_ids are then the expanded prompt
    images: object | None = None
    on_token: Callable[[TokenStep], None] | None = None  # called on the engine thread; must not block
    created: float = field(default_factory=time.time)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    @property
    def wants_token_extras(self) -> bool:
        return self.return_entropy or self.return_logprob and bool(self.top_logprobs_num or self.token_ids_logprob)


@dataclass
class GenerationResult:
    rid: str
    text: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float] | None
    input_logprobs: list[float | None] | None  # from logprob_start_len; the first token has None
    finish_reason: dict | None  # None only in a streamed snapshot of an unfinished request
    prompt_tokens: int
    weight_version: str
    e2e_latency: float
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_token_ids_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_entropy: list[float] | None = None
    routed_experts: np.ndarray | None = None  # [prompt + output - 1, layers, top_k] int32 (megarl/wire/routing.py)
    weight_versions: list[list] | None = None  # [[version, tokens], ...]: run lengths over output_ids
    num_retractions: int = 0  # times the request was retracted (pause mode retract) and re-prefilled
