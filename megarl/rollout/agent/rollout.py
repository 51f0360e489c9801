"""Run an agent loop for every row of a rollout and return the rows the trainer takes.

RolloutManager.generate hands over to `AgentRollout.generate` when `rollout.agent_loop` is set.
All trajectories of a call run concurrently (one asyncio task each; the engines batch their turns).

Sticky engines: every turn of a trajectory goes to ONE engine, by URL, never through the router:
the n trajectories of prompt i all go to live engine i mod E, so the engine's prefix cache holds
the prompt and each trajectory's growing context between its turns. (sglang-router 0.3.2 has no
session key: round_robin, the trainer's default policy, would scatter the turns, and cache_aware
follows prefixes only while load is balanced.)

Failures follow RolloutManager's rules: a prompt whose trajectories fail (engine down after the
client's retries, stale weights, an abort) is run again whole - its n trajectories, tool calls
included - in a new round after the fleet has recovered its dead engines; `rollout/retries`
counts the re-run prompts' requests plus the client's HTTP retries.

Metrics (RolloutManager.last_stats, logged per step): rollout/num_turns (mean model turns per
trajectory), rollout/tool_calls (calls in the call's trajectories), rollout/tool_call_success_rate
(calls that ran and succeeded / calls; 0 without calls), rollout/agent_max_turns_frac.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import torch

from megarl.data.batch import Batch
from megarl.rollout.agent.base import AGENT_LOOPS, AgentLoop, AgentOutput, AgentSample, EngineHandle
from megarl.rollout.client.client import _gather_or_cancel


class AgentRollout:
    def __init__(self, loop: AgentLoop):
        self.loop = loop

    @classmethod
    def from_config(cls, rollout_cfg, tokenizer) -> AgentRollout | None:
        """None when rollout.agent_loop is unset (the single-turn path)."""
        name = rollout_cfg.agent_loop
        if name is None:
            return None
        if name not in AGENT_LOOPS:
            raise ValueError(f"rollout.agent_loop={name!r} is not registered; known: {sorted(AGENT_LOOPS)}")
        return cls(AGENT_LOOPS[name](tokenizer, rollout_cfg.agent, rollout_cfg.max_new_tokens))

    def generate(self, manager, prompts: Batch, sampling, weight_version: str | None = None, on_rows=None) -> Batch:
        """RolloutManager.generate's contract, rows from the agent loop (module doc)."""
        prompt_ids = [list(map(int, p)) for p in prompts["raw_prompt_ids"]]
        columns = {
            k: list(prompts[k]) if k in prompts.non_tensors else [None] * len(prompts)
            for k in ("raw_prompt", "data_source", "ground_truth", "extra_info")
        }
        outputs: list[list[AgentOutput] | None] = [None] * len(prompt_ids)
        stats = manager.run_rounds(
            len(prompt_ids),
            lambda pending: asyncio.run(
                self._round(manager, pending, prompt_ids, columns, sampling, outputs, weight_version, on_rows)
            ),
        )
        rows = [out for outs in outputs for out in outs]
        manager.last_stats = {**stats, **agent_metrics(rows)}
        repeated = prompts.select(*[k for k in prompts.non_tensors]).repeat_interleave(sampling.n)
        return repeated.union(agent_rows_to_batch(rows))

    async def _round(
        self, manager, pending, prompt_ids, columns, sampling, outputs, weight_version, on_rows
    ) -> dict[int, Exception]:
        urls, n = manager.engine_urls(), sampling.n
        params = {k: v for k, v in sampling.to_sglang().items() if k not in ("n", "max_new_tokens")}
        errors: dict[int, Exception] = {}

        async def one_prompt(k: int, i: int) -> None:
            client = manager.client_for(urls[k % len(urls)], True)  # sticky: all n trajectories, every turn
            samples = [
                AgentSample(
                    index=i * n + j,
                    prompt_ids=prompt_ids[i],
                    engine=EngineHandle(client, params, i * n + j, weight_version, sampling.seed),
                    messages=columns["raw_prompt"][i],
                    data_source=columns["data_source"][i],
                    ground_truth=columns["ground_truth"][i],
                    extra_info=columns["extra_info"][i],
                )
                for j in range(n)
            ]
            try:
                outs = await _gather_or_cancel([self.loop.run(s) for s in samples])  # one fails: stop its siblings
            except Exception as exc:  # noqa: BLE001  (the prompt is run again or the failure raised)
                errors[i] = exc
                return
            outputs[i] = list(outs)
            if on_rows is not None:  # the overlap scorer reads .text (a classifier: .output_ids too)
                on_rows([i], [[SimpleNamespace(text=o.text, output_ids=o.response_ids) for o in outs]])

        await asyncio.gather(*[one_prompt(k, i) for k, i in enumerate(pending)])
        return {i: errors[i] for i in sorted(errors)}


def agent_metrics(rows: list[AgentOutput]) -> dict[str, float]:
    calls = sum(r.extras.get("tool_calls", 0) for r in rows)
    successes = sum(r.extras.get("tool_successes", 0) for r in rows)
    return {
        "rollout/num_turns": float(np.mean([r.num_turns for r in rows])) if rows else 0.0,
        "rollout/tool_calls": float(calls),
        "rollout/tool_call_success_rate": successes / calls if calls else 0.0,
        "rollout/agent_max_turns_frac": float(np.mean([r.finish_reason == "max_turns" for r in rows])) if rows else 0.0,
    }


def agent_rows_to_batch(rows: list[AgentOutput]) -> Batch:
    """RolloutManager's row layout (rows_to_batch) with the agent's masks: input_ids = prompt +
    response, response_mask 1 only on the model's tokens, rollout_log_probs 0 where it is 0."""
    n = len(rows)
    R = max(1, max(len(r.response_ids) for r in rows))
    T = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    input_ids = torch.zeros(n, T, dtype=torch.long)
    responses = torch.zeros(n, R, dtype=torch.long)
    response_mask = torch.zeros(n, R, dtype=torch.float32)
    rollout_log_probs = torch.zeros(n, R, dtype=torch.float32)
    for i, r in enumerate(rows):
        k = len(r.response_ids)
        input_ids[i, : len(r.prompt_ids) + k] = torch.tensor(r.prompt_ids + r.response_ids, dtype=torch.long)
        responses[i, :k] = torch.tensor(r.response_ids, dtype=torch.long)
        mask = torch.tensor(r.response_mask, dtype=torch.float32)
        response_mask[i, :k] = mask
        rollout_log_probs[i, :k] = torch.tensor(r.response_logprobs, dtype=torch.float32) * mask
    return Batch(
        tensors={
            "input_ids": input_ids,
            "responses": responses,
            "response_mask": response_mask,
            "prompt_lengths": torch.tensor([len(r.prompt_ids) for r in rows], dtype=torch.long),
            "rollout_log_probs": rollout_log_probs,
            "num_turns": torch.tensor([r.num_turns for r in rows], dtype=torch.long),
        },
        non_tensors={
            "response_text": np.array([r.text for r in rows], dtype=object),
            "finish_reason": np.array([r.finish_reason for r in rows], dtype=object),
            "rollout_weight_version": np.array([r.weight_version for r in rows], dtype=object),
        },
    )
