"""One request's life inside a running batch: its tokens, its stopping rules, its result.

Pure bookkeeping (no scheduler, no model): the engine owns the rows and calls these between
forward steps on its scheduler thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from megarl.rollout.engine.logit_processing import chosen_logprobs, top_logprobs
from megarl.rollout.engine.protocol import GenerationRequest, GenerationResult, TokenStep
from megarl.wire.routing import row_records

Decode = Callable[[list[int], bool, bool], str]  # (ids, skip_special_tokens, spaces_between_special_tokens)


class Row:
    """One request while it is in a batch."""

    def __init__(self, req: GenerationRequest, default_generator: torch.Generator):
        self.req = req
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.steps: list[TokenStep] = []  # kept only when the request asked for per-token extras
        self.input_logprobs: list[float | None] | None = None
        self.input_top_logprobs: list | None = None
        self.input_token_ids_logprobs: list | None = None
        self.routed: list[torch.Tensor] = []  # [tokens, layers, top_k] pieces (routing.BatchCapture)
        self.stop_span: tuple[int, int] | None = None  # where a stop string / regex matched the text
        self.finish: dict | None = None
        self.versions: list[str | None] = []  # per output token: the weight_version that produced it
        self.abort_message: str | None = None  # set (under the engine's lock) by an abort while running
        self.retractions = 0  # times retracted to the queue (its KV freed) and re-prefilled
        seed = req.params.sampling_seed
        self.generator = default_generator if seed is None else torch.Generator().manual_seed(seed)

    def fed_ids(self) -> list[int]:
        """What a prefill of this row feeds: the prompt, and after a retraction the output so far."""
        return self.req.input_ids + self.output_ids

    def record(self, step: TokenStep) -> None:
        self.output_ids.append(step.token)
        self.logprobs.append(step.logprob)
        self.versions.append(step.weight_version)
        if self.req.wants_token_extras:
            self.steps.append(step)
        if self.req.on_token is not None:
            self.req.on_token(step)


def wants_input_logprobs(row: Row) -> bool:
    """Whether this prefill owes the row its prompt log-probs (not a re-prefill after a retraction:
    those were computed by the first one, with the weights of that time)."""
    req = row.req
    return req.return_logprob and req.logprob_start_len >= 0 and row.retractions == 0


def fill_input_logprobs(rows: list[Row], logits: torch.Tensor, ids: torch.Tensor) -> None:
    """Prompt log-probs from logprob_start_len for the rows that asked, from left-padded prefill
    logits (rows, width, vocab) and ids (rows, width)."""
    width = ids.shape[1]
    for b, row in enumerate(rows):
        req = row.req
        if not wants_input_logprobs(row):
            continue
        pad, temperature, start = width - len(req.input_ids), req.params.temperature, req.logprob_start_len
        # logits at padded position pad+j-1 predict prompt token j
        scaled = logits[b, pad : width - 1].float() / (temperature if temperature > 0 else 1.0)
        full = torch.log_softmax(scaled, dim=-1)
        row.input_logprobs = ([None] + full.gather(-1, ids[b, pad + 1 :, None])[:, 0].tolist())[start:]
        if req.top_logprobs_num:  # nothing predicts the first prompt token: None there, as in SGLang
            row.input_top_logprobs = ([None] + top_logprobs(full, req.top_logprobs_num))[start:]
        if req.token_ids_logprob:
            row.input_token_ids_logprobs = ([None] + chosen_logprobs(full, req.token_ids_logprob))[start:]


def stop_reason(row: Row, eos_token_ids: frozenset[int], decode: Decode) -> dict | None:
    """SGLang's order: length, then stop tokens (all skipped by ignore_eos), then stop strings,
    then stop regexes (the finish reason names the pattern, as SGLang's does)."""
    p, token = row.req.params, row.output_ids[-1]
    if len(row.output_ids) >= p.max_new_tokens:
        return {"type": "length", "length": p.max_new_tokens}
    if not p.ignore_eos and (token in p.stop_token_ids or token in eos_token_ids):
        return {"type": "stop", "matched": token}
    if p.stop or p.stop_regex:
        text = decode(row.output_ids, p.skip_special_tokens, p.spaces_between_special_tokens)
        for s in p.stop:
            if s in text:
                row.stop_span = (text.find(s), text.find(s) + len(s))
                return {"type": "stop", "matched": s}
        for pattern in p.stop_regex:
            match = pattern.search(text)
            if match:
                row.stop_span = match.span()
                return {"type": "stop", "matched": pattern.pattern}
    return None


def run_lengths(versions: list) -> list[list]:
    """[[version, count], ...] in order: meta_info's weight_versions (generate_output.py)."""
    runs: list[list] = []
    for version in versions:
        if runs and runs[-1][0] == version:
            runs[-1][1] += 1
        else:
            runs.append([version, 1])
    return runs


def finished_result(row: Row, finish: dict, decode: Decode, weight_version: str) -> GenerationResult:
    row.finish, req, p = finish, row.req, row.req.params
    text_ids = row.output_ids
    if finish["type"] == "stop" and isinstance(finish.get("matched"), int) and not p.no_stop_trim:
        text_ids = text_ids[:-1]  # the matched stop token is not part of the text
    text = decode(text_ids, p.skip_special_tokens, p.spaces_between_special_tokens)
    if finish["type"] == "stop" and row.stop_span is not None:
        # SGLang cuts before the match, or with no_stop_trim just after it
        text = text[: row.stop_span[1] if p.no_stop_trim else row.stop_span[0]]
    lp, extras = req.return_logprob, req.return_logprob and req.wants_token_extras
    top, chosen = extras and bool(req.top_logprobs_num), extras and bool(req.token_ids_logprob)
    return GenerationResult(
        rid=req.rid,
        text=text,
        input_ids=req.input_ids,
        output_ids=list(row.output_ids),
        output_logprobs=list(row.logprobs) if lp else None,
        input_logprobs=row.input_logprobs if lp else None,
        finish_reason=finish,
        prompt_tokens=len(req.input_ids),
        weight_version=weight_version,
        e2e_latency=time.time() - req.created,
        output_top_logprobs=[s.top_logprobs for s in row.steps] if top else None,
        input_top_logprobs=row.input_top_logprobs if lp else None,
        output_token_ids_logprobs=[s.token_ids_logprobs for s in row.steps] if chosen else None,
        input_token_ids_logprobs=row.input_token_ids_logprobs if lp else None,
        output_entropy=[s.entropy for s in row.steps] if req.return_entropy else None,
        routed_experts=(
            row_records(row.routed, len(req.input_ids) + len(row.output_ids) - 1) if req.return_routed_experts else None
        ),
        weight_versions=run_lengths(row.versions),
        num_retractions=row.retractions,
    )
