"""RolloutManager: turn a batch of prompts into a batch of (prompt, response) rows.

Talks to one or more SGLang-API servers (embedded or real SGLang, directly or via
sglang-router) through RolloutClient, spreading prompts round-robin over the URLs. By default
(batched=True) each server gets its share in one batched /generate (or chunks of
`max_batch_prompts`): one HTTP round trip per server instead of one per prompt. Pass
batched=False when a URL is an sglang-router: it balances individual requests over its workers
but sends a batched request to a single one. Every request is answered or raises (the client
retries transient failures): no row is silently dropped.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import torch

from megarl.data.batch import Batch
from megarl.rollout.client import GenerateOutput, RolloutClient


@dataclass
class SamplingSpec:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16

    def to_sglang(self) -> dict:
        params = {"n": self.n, "temperature": self.temperature, "top_p": self.top_p,
                  "max_new_tokens": self.max_new_tokens}
        if self.top_k > 0:
            params["top_k"] = self.top_k
        return params


class RolloutManager:
    def __init__(self, server_urls: list[str], timeout_s: float = 600.0, max_retries: int = 3, *,
                 batched: bool = True, max_batch_prompts: int | None = None):
        if not server_urls:
            raise ValueError("rollout: no server URLs")
        self.clients = [RolloutClient(u, batched=batched, max_batch_prompts=max_batch_prompts,
                                      timeout_s=timeout_s, max_retries=max_retries)
                        for u in server_urls]

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def generate(self, prompts: Batch, sampling: SamplingSpec) -> Batch:
        """rows = len(prompts) * n, prompt-major (the n samples of a prompt are adjacent).

        Requires the non-tensor column `raw_prompt_ids`; every other non-tensor column of
        `prompts` is repeated onto its rows.
        """
        prompt_ids = [list(map(int, p)) for p in prompts["raw_prompt_ids"]]
        shards = [list(range(i, len(prompt_ids), len(self.clients))) for i in range(len(self.clients))]
        work = [(c, idx) for c, idx in zip(self.clients, shards) if idx]

        async def all_servers():
            return await asyncio.gather(*[
                c.agenerate([prompt_ids[i] for i in idx], sampling.to_sglang(), return_logprob=True)
                for c, idx in work])

        outputs: list[list[GenerateOutput] | None] = [None] * len(prompt_ids)
        for (_, idx), flat in zip(work, asyncio.run(all_servers())):
            for k, i in enumerate(idx):
                outputs[i] = flat[k * sampling.n:(k + 1) * sampling.n]
        rows = [(prompt_ids[i], out) for i, outs in enumerate(outputs) for out in outs]
        _check_finished(rows)
        batch = rows_to_batch(rows)
        repeated = prompts.select(*[k for k in prompts.non_tensors]).repeat_interleave(sampling.n)
        return repeated.union(batch)


def _check_finished(rows) -> None:
    for i, (_, out) in enumerate(rows):
        if out.finish_reason.get("type") == "abort":
            raise RuntimeError(f"rollout row {i} was aborted by the server: "
                               f"{out.finish_reason.get('message')}")
        if out.output_logprobs is None or len(out.output_logprobs) != len(out.output_ids):
            raise RuntimeError(f"rollout row {i}: server returned no per-token log-probs "
                               "(return_logprob was requested)")


def rows_to_batch(rows: list[tuple[list[int], GenerateOutput]]) -> Batch:
    """Right-padded tensors: input_ids = prompt + response; responses, masks, rollout log-probs."""
    n = len(rows)
    R = max(1, max(len(out.output_ids) for _, out in rows))
    T = max(len(p) + len(out.output_ids) for p, out in rows)
    input_ids = torch.zeros(n, T, dtype=torch.long)
    responses = torch.zeros(n, R, dtype=torch.long)
    response_mask = torch.zeros(n, R, dtype=torch.float32)
    rollout_log_probs = torch.zeros(n, R, dtype=torch.float32)
    for i, (prompt, out) in enumerate(rows):
        resp = out.output_ids
        input_ids[i, : len(prompt) + len(resp)] = torch.tensor(prompt + resp, dtype=torch.long)
        responses[i, : len(resp)] = torch.tensor(resp, dtype=torch.long)
        response_mask[i, : len(resp)] = 1.0
        rollout_log_probs[i, : len(resp)] = torch.tensor(out.output_logprobs, dtype=torch.float32)
    return Batch(
        tensors={
            "input_ids": input_ids,
            "prompt_lengths": torch.tensor([len(p) for p, _ in rows], dtype=torch.long),
            "responses": responses,
            "response_mask": response_mask,
            "rollout_log_probs": rollout_log_probs,
        },
        non_tensors={
            "response_text": np.array([out.text for _, out in rows], dtype=object),
            "finish_reason": np.array([out.finish_reason.get("type", "") for _, out in rows],
                                      dtype=object),
        },
    )
