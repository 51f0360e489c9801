"""RolloutManager: turn a batch of prompts into a batch of (prompt, response) rows.

Talks to SGLang-API servers (embedded or real SGLang) through RolloutClient. Three routes:

- a router (sglang-router, `RolloutFleet.router_url`): one /generate per prompt carrying all n
  samples, so the router sends them whole to one engine (prefix reuse) and balances prompts;
- engines directly (batched=True, the default): prompts spread round-robin over the engines,
  each engine's share in one batched /generate (or chunks of `max_batch_prompts`);
- batched=False without a router: one /generate per prompt, round-robin over the engines.

Nothing is dropped. The client retries transport errors and 5xx per request; a prompt whose
request still fails is re-sent in a new round after the fleet (when there is one) has taken
dead engines out of service and started their restart: to the engines still alive, or to the
restarted engine once it has the current weights. Every re-send is counted: `last_stats` has
`rollout/retries` and `rollout/engine_restarts` for the last call. Without a fleet, or when no
engine is found dead, the failure is raised with the server's message.

`weight_version` (the trainer's last synced version) is checked against the version every answer
reports in meta_info (SGLang's field; the embedded server's too): an answer from an engine with
other weights is not used but re-sent like a failed request, and raised (StaleWeightsError's
message) if it persists. The served version of every row is its `rollout_weight_version`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from megarl.data.batch import Batch
from megarl.models.vision import MM_COLUMN
from megarl.rollout.client.client import GenerateOutput, RolloutClient, RolloutRequestError
from megarl.rollout.client.images import image_data_of, model_rows, prompt_images
from megarl.rollout.client.partial import token_version_runs
from megarl.wire.routing import batch_column


@dataclass
class SamplingSpec:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    # deterministic sampling: row r of a call (prompt-major, r = prompt * n + sample) is sent alone
    # with sampling_seed = row_seed(seed, r); None: the engines' own generators decide
    seed: tuple[int, ...] | None = None
    # MoE routing replay (actor.moe.routing_replay): ask for SGLang's routed_experts; the rows get
    # the Batch column `routed_experts` (megarl/wire/routing.py)
    return_routed_experts: bool = False

    def to_sglang(self) -> dict:
        params = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
        }
        if self.top_k > 0:
            params["top_k"] = self.top_k
        return params


class RolloutManager:
    def __init__(
        self,
        server_urls: list[str] | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        *,
        batched: bool = True,
        max_batch_prompts: int | None = None,
        api_key: str | None = None,
        fleet=None,
        max_rounds: int = 4,
        agent=None,
        vision=None,
    ):
        """server_urls: fixed engines; or `fleet` (a RolloutFleet), whose router / live engines are
        asked on every call, and which restarts engines that die. `agent`: an AgentRollout
        (rollout.agent_loop, megarl/rollout/agent/rollout.py) that makes the rows instead.
        `vision`: a vision-language model's models.vision.PromptImages (prompts with images, images.py)."""
        if not server_urls and fleet is None:
            raise ValueError("rollout: no server URLs and no fleet")
        self._fixed_urls, self.fleet = list(server_urls or []), fleet
        self._client_options = dict(
            timeout_s=timeout_s, max_retries=max_retries, max_batch_prompts=max_batch_prompts, api_key=api_key
        )
        self.batched, self.max_rounds, self.agent, self.vision = batched, max_rounds, agent, vision
        self._clients: dict[tuple[str, bool], RolloutClient] = {}
        self.last_stats: dict[str, float] = {}
        self.lora_path: str | None = None  # the LoRA adapter every request names (use_lora_adapter)

    @property
    def clients(self) -> list[RolloutClient]:
        return [self.client_for(url, self.batched) for url in self.engine_urls()]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def generate(
        self, prompts: Batch, sampling: SamplingSpec, weight_version: str | None = None, on_rows=None
    ) -> Batch:
        """rows = len(prompts) * n, prompt-major (the n samples of a prompt are adjacent).
        `weight_version`: the version every answer must report (None: not checked).
        `on_rows(prompt_indices, outputs)`: called (on the request loop: keep it quick) as each
        request's answer is accepted, with its prompts' indices and their n GenerateOutputs each;
        every prompt is handed over exactly once, a re-sent one when its re-send succeeds. Rows
        of prompt i are i * n .. i * n + n - 1 of the result (megarl.reward.model's overlap).

        Requires the non-tensor column `raw_prompt_ids`; every other non-tensor column of
        `prompts` is repeated onto its rows. Prompts with images (the `images` column) send them
        as `image_data`; their rows' input_ids hold the expanded image pads and MM_COLUMN the
        images' model inputs (images.py).
        """
        images = prompt_images(prompts)
        if self.agent is not None:  # multi-turn trajectories, same row layout (agent/rollout.py)
            if images is not None:
                raise ValueError("rollout.agent_loop does not send images yet; use prompts without images")
            return self.agent.generate(self, prompts, sampling, weight_version, on_rows)
        prompt_ids = [list(map(int, p)) for p in prompts["raw_prompt_ids"]]
        sent = None if images is None else image_data_of(images)
        outputs: list[list[GenerateOutput] | None] = [None] * len(prompt_ids)
        self.last_stats = self.run_rounds(
            len(prompt_ids),
            lambda pending: asyncio.run(
                self._round(pending, prompt_ids, sampling, outputs, weight_version, on_rows, sent)
            ),
        )
        model_ids, inputs = (prompt_ids, None) if images is None else model_rows(prompt_ids, images, self.vision)
        rows = [(model_ids[i], out) for i, outs in enumerate(outputs) for out in outs]
        _check_finished(rows)
        batch = rows_to_batch(rows, routed_experts=sampling.return_routed_experts)
        if inputs is not None:
            batch[MM_COLUMN] = [inputs[i] for i, outs in enumerate(outputs) for _ in outs]
        repeated = prompts.select(*[k for k in prompts.non_tensors]).repeat_interleave(sampling.n)
        return repeated.union(batch)

    def run_rounds(self, count: int, run_round: Callable[[list[int]], dict[int, Exception]]) -> dict[str, float]:
        """Prompts 0..count-1 through `run_round(pending) -> failures by prompt index` until none
        fails: after a failed round the fleet restarts the engines that died and the failed
        prompts go again, at most `max_rounds` rounds (a failure without a dead engine is raised
        after the second); then recovery is finished. Returns rollout/retries and
        rollout/engine_restarts. The single-turn path and the agent loop both go through here."""
        retries_before, restarts_before = self._client_retries(), self._restarts()
        pending, resent = list(range(count)), 0
        for round_index in range(self.max_rounds):
            failures = run_round(pending)
            if not failures:
                break
            dead = self.fleet.recover() if self.fleet is not None else []
            if not dead and round_index > 0 or self.fleet is None or round_index == self.max_rounds - 1:
                raise _failed(failures, round_index + 1)
            pending, resent = sorted(failures), resent + len(failures)
        retried = self._client_retries() - retries_before + resent
        if self.fleet is not None:
            if retried:  # requests were re-sent (the router may have carried them elsewhere):
                self.fleet.recover()  # an engine that failed them must not stay dead unnoticed
            self.fleet.finish_recovery()
        return {
            "rollout/retries": float(retried),
            "rollout/engine_restarts": float(self._restarts() - restarts_before),
        }

    # ---- one round over the current targets ------------------------------------------------------
    async def _round(
        self,
        pending: list[int],
        prompt_ids,
        sampling: SamplingSpec,
        outputs,
        weight_version: str | None = None,
        on_rows=None,
        image_data: list | None = None,
    ) -> dict[int, Exception]:
        """Send every pending prompt once; fill `outputs` as each request finishes (and hand its
        prompts to `on_rows`); return the failures by prompt index. `image_data`: each prompt's."""
        work = self._requests(pending, prompt_ids, sampling)
        errors: dict[int, Exception] = {}  # by request

        async def send(k: int, client: RolloutClient, idx: list[int], ids, params) -> None:
            per_row = len(ids) // len(idx)  # the seeded path sends each prompt n times
            images = None if image_data is None else [image_data[i] for i in idx for _ in range(per_row)]
            try:
                result = await client.agenerate(
                    ids,
                    params,
                    return_logprob=True,
                    return_routed_experts=sampling.return_routed_experts,
                    image_data=images,
                )
            except Exception as exc:  # noqa: BLE001  (the prompts are re-sent or the failure raised)
                errors[k] = exc
                return
            stale = _stale(result, idx, weight_version, sampling.n)
            if stale is not None:
                errors[k] = stale
                return
            for j, i in enumerate(idx):
                outputs[i] = result[j * sampling.n : (j + 1) * sampling.n]
            if on_rows is not None:
                on_rows(idx, [outputs[i] for i in idx])

        await asyncio.gather(*[send(k, *request) for k, request in enumerate(work)])
        failures: dict[int, Exception] = {}
        for k in sorted(errors):  # in request order, whatever order they failed in
            failures.update(dict.fromkeys(work[k][1], errors[k]))
        return failures

    def _requests(self, pending: list[int], prompt_ids, sampling: SamplingSpec) -> list[tuple]:
        """(client, prompt indices, input_ids, sampling_params) of each /generate of a round."""
        params, n = sampling.to_sglang(), sampling.n
        router = self.fleet.router_url if self.fleet is not None else None
        if sampling.return_routed_experts:  # sglang-router 0.3.2 drops the field from the body
            router = None  # (measured): engines directly
        if sampling.seed is not None:
            # every row alone with its own seed, each engine's share in ONE batched request, never
            # through the router: an engine batches exactly these rows together whatever the
            # timing, so no row's numbers depend on what else happened to be running
            one = {**params, "n": 1}
            urls = self.engine_urls()
            return [
                (
                    self.client_for(url, True),
                    idx,
                    [prompt_ids[i] for i in idx for _ in range(n)],
                    [{**one, "sampling_seed": row_seed(sampling.seed, i * n + j)} for i in idx for j in range(n)],
                )
                for url, idx in zip(urls, _shards(pending, len(urls)))
                if idx
            ]
        if router is not None or not self.batched:
            urls = [router] if router is not None else self.engine_urls()
            return [
                (self.client_for(urls[k % len(urls)], False), [i], [prompt_ids[i]], params)
                for k, i in enumerate(pending)
            ]
        urls = self.engine_urls()
        return [
            (self.client_for(url, True), idx, [prompt_ids[i] for i in idx], params)
            for url, idx in zip(urls, _shards(pending, len(urls)))
            if idx
        ]

    def engine_urls(self) -> list[str]:
        """The engines requests go to now (the fleet's live ones, or the fixed URLs)."""
        urls = self.fleet.live_urls() if self.fleet is not None else self._fixed_urls
        if not urls:
            raise RolloutRequestError("rollout: no live engine to send requests to")
        return urls

    def client_for(self, url: str, batched: bool) -> RolloutClient:
        """The manager's client for `url` (one per URL and mode, kept for the manager's life)."""
        key = (url, batched)
        if key not in self._clients:
            self._clients[key] = RolloutClient(url, batched=batched, **self._client_options)
        self._clients[key].lora_path = self.lora_path
        return self._clients[key]

    def use_lora_adapter(self, name: str | None) -> None:
        """From now on every request names LoRA adapter `name` (SGLang's lora_path; None: the base),
        the clients made later too."""
        self.lora_path = name
        for client in self._clients.values():
            client.lora_path = name
        if self.fleet is not None:  # its clients score the parity probe's rows
            self.fleet.use_lora_adapter(name)

    def _client_retries(self) -> int:
        return sum(c.retries for c in self._clients.values())

    def _restarts(self) -> int:
        return self.fleet.restarts if self.fleet is not None else 0


def _shards(pending: list[int], parts: int) -> list[list[int]]:
    return [pending[k::parts] for k in range(parts)]


def row_seed(seed: tuple[int, ...], row: int) -> int:
    """A 63-bit sampling seed for one row, well mixed from (seed..., row) (numpy's SeedSequence)."""
    hi, lo = np.random.SeedSequence([*seed, row]).generate_state(2, np.uint32)
    return (int(hi) << 31) ^ int(lo)


class StaleWeightsError(RuntimeError):
    """An engine answered with a weight version other than the one the trainer synced last."""


def _stale(outputs: list[GenerateOutput], idx: list[int], expected: str | None, n: int) -> StaleWeightsError | None:
    if expected is None:
        return None
    for k, out in enumerate(outputs):
        served = out.meta_info.get("weight_version")
        if served is not None and str(served) != expected:
            return StaleWeightsError(
                f"prompt {idx[k // n]} was served with weight_version {served!r}, but the engines were "
                f"synced to {expected!r}: an engine generates with weights other than the trainer's"
            )
    return None


def _failed(failures: dict[int, Exception], rounds: int) -> RolloutRequestError:
    first = next(iter(failures.values()))
    return RolloutRequestError(
        f"rollout: {len(failures)} prompts still failed after {rounds} round(s) "
        f"(prompts {sorted(failures)[:8]}...); first error: {first}"
    )


def _check_finished(rows) -> None:
    for i, (_, out) in enumerate(rows):
        if out.finish_reason.get("type") == "abort":
            raise RuntimeError(f"rollout row {i} was aborted by the server: {out.finish_reason.get('message')}")
        if out.output_logprobs is None or len(out.output_logprobs) != len(out.output_ids):
            raise RuntimeError(
                f"rollout row {i}: server returned no per-token log-probs (return_logprob was requested)"
            )


# the non-tensor columns rows_to_batch adds; a rollout's other non-tensor columns are its prompts'
GENERATED_NON_TENSORS = (
    "response_text",
    "finish_reason",
    "rollout_weight_version",
    "rollout_start_version",
)  # the last: fully_async's (trainer/async_rollout.py)


def rows_to_batch(rows: list[tuple[list[int], GenerateOutput]], routed_experts: bool = False) -> Batch:
    """Right-padded tensors: input_ids = prompt + response; responses, masks, rollout log-probs;
    with `routed_experts`, the MoE routing records aligned with input_ids (routing.batch_column)."""
    n = len(rows)
    R = max(1, max(len(out.output_ids) for _, out in rows))
    T = max(len(p) + len(out.output_ids) for p, out in rows)
    # padded as lists, one tensor each: indexed writes row by row took a third of the driver's CPU
    input_ids = torch.tensor(
        [p + out.output_ids + [0] * (T - len(p) - len(out.output_ids)) for p, out in rows], dtype=torch.long
    ).reshape(n, T)
    pad = [[0] * (R - len(out.output_ids)) for _, out in rows]
    responses = torch.tensor([out.output_ids + z for (_, out), z in zip(rows, pad)], dtype=torch.long).reshape(n, R)
    response_mask = torch.tensor(
        [[1.0] * len(out.output_ids) + z for (_, out), z in zip(rows, pad)], dtype=torch.float32
    ).reshape(n, R)
    rollout_log_probs = torch.tensor(
        [list(out.output_logprobs) + z for (_, out), z in zip(rows, pad)], dtype=torch.float32
    ).reshape(n, R)
    # the weights' version that produced each token (-1: unknown, and padding)
    versions = torch.tensor([_token_versions(out, R) for _, out in rows], dtype=torch.long).reshape(n, R)
    return Batch(
        tensors={
            "input_ids": input_ids,
            "prompt_lengths": torch.tensor([len(p) for p, _ in rows], dtype=torch.long),
            "responses": responses,
            "response_mask": response_mask,
            "rollout_log_probs": rollout_log_probs,
            "rollout_versions": versions,
            **({"routed_experts": batch_column(rows, T)} if routed_experts else {}),
        },
        non_tensors={
            "response_text": np.array([out.text for _, out in rows], dtype=object),
            "finish_reason": np.array([out.finish_reason.get("type", "") for _, out in rows], dtype=object),
            "rollout_weight_version": np.array([out.meta_info.get("weight_version") for _, out in rows], dtype=object),
        },
    )


def _token_versions(out: GenerateOutput, width: int) -> list[int]:
    """One answer's per-token versions (partial.token_version_runs), padded to `width` with -1;
    a label that is not a trainer version ("default", the initial weights) is 0, another -1."""
    runs = token_version_runs(out) or []
    labels = [label for label, count in runs for _ in range(int(count))][: len(out.output_ids)]
    numbers = [0 if v == "default" else int(v) if str(v).lstrip("-").isdigit() else -1 for v in labels]
    return numbers + [-1] * (width - len(numbers))
