"""Client for any server that speaks SGLang's HTTP API: SGLang, sglang-router, megarl's embedded server.

The controller generates for a whole batch at once. `generate` returns a flat list of
len(prompts) * n outputs in prompt-major order ([p0s0, p0s1, ..., p1s0, ...], as SGLang does) and
has two ways of getting there, chosen by the constructor flag `batched`:

- batched=True (default): one /generate per call whose `input_ids` is the list of prompts
  (SGLang's batched form), or one per chunk of `max_batch_prompts` prompts, chunks sent
  concurrently. Use it when `base_url` is a server (SGLang or the embedded one): one HTTP round
  trip instead of one per prompt (~2.5 ms of CPU on each side per request) and the server gets the
  whole batch at once. Every prompt must ask for the same n (SGLang's rule for batched input).
- batched=False: one /generate per prompt, all concurrent (bounded by `max_concurrency`). Use it
  behind sglang-router: the router balances individual requests over its workers, but dispatches a
  batched request to a single worker.

Connection errors, timeouts and 5xx answers are retried with exponential backoff, per HTTP request (a
batched request is retried whole); after `max_retries` retries the call raises `RolloutRequestError`
naming the URL, the prompts and the sampling params. A 4xx is the caller's
mistake and raises at once with the server's message. An answer with the wrong number of outputs
raises too. No request is ever dropped silently.

The public methods are synchronous (the controller is plain Python); they run on a private event loop
thread, so they also work inside another event loop. `agenerate` is the awaitable form (the agent loop).

`api_key` (default: the MEGARL_ROLLOUT_API_KEY environment variable, the one the embedded server
reads, so a run sets it once for every process) is sent as `Authorization: Bearer KEY` on every
request; SGLang and sglang-router take the same header for their --api-key.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from megarl.rollout.client.server_calls import ServerCalls
from megarl.rollout.client.weight_calls import WeightCalls

__all__ = ["GenerateOutput", "RolloutClient", "RolloutRequestError"]

API_KEY_ENV = "MEGARL_ROLLOUT_API_KEY"  # the embedded server's variable (megarl.rollout.server.auth)


class RolloutRequestError(RuntimeError):
    """A request failed for good: rejected by the server, or still failing after every retry."""


@dataclass
class GenerateOutput:
    output_ids: list[int]
    text: str
    output_logprobs: list[float] | None  # one per output token, when return_logprob was set
    finish_reason: dict
    meta_info: dict  # the server's meta_info, untouched

    @classmethod
    def from_response(cls, item: dict) -> GenerateOutput:
        meta = item.get("meta_info", {})
        triples = meta.get("output_token_logprobs")
        return cls(
            output_ids=list(item.get("output_ids") or []),
            text=item.get("text", ""),
            output_logprobs=None if triples is None else [t[0] for t in triples],
            finish_reason=meta.get("finish_reason") or {},
            meta_info=meta,
        )


class RolloutClient(ServerCalls, WeightCalls):
    """`batched`: one /generate per call (servers) or one per prompt (routers); see the module doc.
    `max_batch_prompts`: in batched mode, split calls with more prompts into chunks of at most this
    many, sent concurrently (None: never split). `api_key`: see the module doc."""

    def __init__(
        self,
        base_url: str,
        *,
        batched: bool = True,
        max_batch_prompts: int | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        max_concurrency: int = 256,
        api_key: str | None = None,
    ):
        if max_batch_prompts is not None and max_batch_prompts < 1:
            raise ValueError(f"max_batch_prompts={max_batch_prompts} must be >= 1 (or None: never split)")
        self.base_url, self.lora_path = base_url.rstrip("/"), None  # lora_path: the adapter requests name
        self.batched, self.max_batch_prompts = batched, max_batch_prompts
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self._timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        self._max_concurrency = max_concurrency
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.retries = 0  # HTTP requests re-sent after a transport error or a 5xx
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()
        self._http: httpx.AsyncClient = self._run(self._open())

    async def _open(self) -> httpx.AsyncClient:
        self._semaphore = asyncio.Semaphore(self._max_concurrency)
        limits = httpx.Limits(max_connections=self._max_concurrency, max_keepalive_connections=64)
        # Building an SSL context loads the CA bundle (~20-40 ms per client); plain http never uses it.
        verify = urlsplit(self.base_url).scheme != "http"
        return httpx.AsyncClient(timeout=self._timeout, limits=limits, verify=verify, headers=self._headers)

    def _submit(self, coro) -> concurrent.futures.Future:
        if not self._thread.is_alive():
            coro.close()  # it will never run; closing it avoids a "never awaited" warning
            raise RuntimeError(f"RolloutClient for {self.base_url} is closed; create a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro):
        return self._submit(coro).result()

    def close(self) -> None:
        if self._thread.is_alive():
            self._run(self._http.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- transport ----------------------------------------------------------------------------
    async def _request(
        self, method: str, path: str, payload: dict | None, what: str, retry: bool = True
    ) -> httpx.Response:
        """Send with retries (unless `retry` is False); returns a response with status < 500 (callers check 4xx)."""
        url, last_error = f"{self.base_url}{path}", ""
        attempts = self.max_retries + 1 if retry else 1
        for attempt in range(attempts):
            try:
                async with self._semaphore:
                    response = await self._http.request(method, url, json=payload)
                if response.status_code < 500:
                    return response
                last_error = f"HTTP {response.status_code}: {response.text[:500]}"
            except httpx.TransportError as exc:  # connect/read/write errors and timeouts
                last_error = f"{type(exc).__name__}: {exc or 'no detail'}"
            if attempt < attempts - 1:
                self.retries += 1  # every re-send is counted (the trainer logs rollout/retries)
                await asyncio.sleep(min(self.backoff_s * 2**attempt, self.max_backoff_s))
        raise RolloutRequestError(
            f"{method} {url} failed {'once' if attempts == 1 else f'{attempts} times'} for {what}; "
            f"last error: {last_error}. "
            "Check that the rollout server is up (its log says why it failed)."
        )

    async def _json(
        self, method: str, path: str, payload: dict | None = None, what: str | None = None, retry: bool = True
    ) -> Any:
        what = what or path
        response = await self._request(method, path, payload, what, retry)
        if response.status_code >= 400:
            raise RolloutRequestError(
                f"{self.base_url}{path} rejected {what}: HTTP {response.status_code}: {_message(response)}"
            )
        # orjson: a 256-row /generate answer parses in 0.5 ms instead of json's 1.6
        return orjson.loads(response.content) if response.content else None

    async def _control(self, path: str, payload: dict | None = None, retry: bool = True) -> dict:
        """Control endpoints answer {"success", "message"}; success false raises."""
        body = await self._json("POST", path, payload, retry=retry)
        if isinstance(body, dict) and body.get("success") is False:
            raise RolloutRequestError(f"{self.base_url}{path} failed: {body.get('message')}")
        return body

    # ---- generation ---------------------------------------------------------------------------
    def _adapter(self) -> dict:  # SGLang's lora_path, once bridge.transport=adapter loaded one
        return {} if self.lora_path is None else {"lora_path": self.lora_path}

    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: dict | list[dict] | None = None,
        return_logprob: bool = False,
        rids: list[str] | None = None,
        return_routed_experts: bool = False,
    ) -> list[GenerateOutput]:
        """len(input_ids) * n outputs, prompt-major. `sampling_params`: one dict for every prompt or
        one per prompt; `rids`: one request id per prompt (the server suffixes -j when n > 1).
        `return_routed_experts`: SGLang's field; each output's meta_info["routed_experts"] then
        holds its MoE routing record (megarl/wire/routing.py)."""
        return self._run(
            self._generate_all(input_ids, sampling_params, _fields(return_logprob, return_routed_experts), rids)
        )

    async def agenerate(
        self,
        input_ids: list[list[int]],
        sampling_params: dict | list[dict] | None = None,
        return_logprob: bool = False,
        rids: list[str] | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int | None = None,
        image_data: list[list[str] | None] | None = None,
    ) -> list[GenerateOutput]:
        """`routed_experts_start_len` (SGLang's field): the first token whose routing record is
        returned, for every prompt (None: the server's default, 0). `image_data` (SGLang's field):
        per prompt its images (base64-encoded files, in the order of the prompt's one image pad
        each) or None; a vision-language server expands the pads itself."""
        fields = _fields(return_logprob, return_routed_experts)
        if routed_experts_start_len is not None:
            fields["routed_experts_start_len"] = routed_experts_start_len
        coro = self._generate_all(input_ids, sampling_params, fields, rids, image_data)
        return await asyncio.wrap_future(self._submit(coro))

    async def _generate_all(self, input_ids, sampling_params, fields, rids, images=None) -> list[GenerateOutput]:
        if not isinstance(input_ids, list) or not all(isinstance(p, list) for p in input_ids):
            raise TypeError("input_ids must be a list of prompts, each a list of token ids")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(input_ids)
        if len(params) != len(input_ids) or any(x is not None and len(x) != len(input_ids) for x in (rids, images)):
            raise ValueError(
                f"{len(input_ids)} prompts but {len(params)} sampling_params / "
                f"{None if rids is None else len(rids)} rids"
            )
        if not input_ids:
            return []
        if self.batched:
            return await self._generate_batched(input_ids, sampling_params, params, fields, rids, images)
        per_prompt = await _gather_or_cancel(
            [
                self._generate_one(i, ids, p, fields | _images(images, i, i + 1), None if rids is None else rids[i])
                for i, (ids, p) in enumerate(zip(input_ids, params))
            ]
        )
        return [out for outputs in per_prompt for out in outputs]

    async def _generate_one(self, index, ids, params, fields, rid) -> list[GenerateOutput]:
        payload = {"input_ids": ids, "sampling_params": params, **fields, **self._adapter()}
        if rid is not None:
            payload["rid"] = rid
        what = f"prompt {index} ({len(ids)} tokens, rid={rid}, sampling_params={params})"
        body = await self._json("POST", "/generate", payload, what)
        items = body if isinstance(body, list) else [body]
        expected = _samples_per_prompt(params)
        if len(items) != expected:
            raise RolloutRequestError(
                f"{self.base_url}/generate answered {len(items)} outputs for {what}, expected n={expected}"
            )
        return [GenerateOutput.from_response(item) for item in items]

    async def _generate_batched(self, input_ids, sampling_params, params, fields, rids, images=None):
        counts = sorted({_samples_per_prompt(p) for p in params})
        if len(counts) > 1:
            raise ValueError(
                f"sampling_params ask for different n per prompt ({counts}); a batched /generate "
                "needs one n for every prompt (as in SGLang): use RolloutClient(batched=False) "
                "or split the call by n"
            )
        size = self.max_batch_prompts or len(input_ids)
        per_prompt_params = isinstance(sampling_params, list)
        tasks = []
        for start in range(0, len(input_ids), size):
            end = min(start + size, len(input_ids))
            chunk_params = params[start:end] if per_prompt_params else params[0]
            what = _describe_batch(input_ids[start:end], chunk_params, start, len(input_ids))
            tasks.append(
                self._generate_chunk(
                    input_ids[start:end],
                    chunk_params,
                    counts[0],
                    fields | _images(images, start, end, batched=True),
                    None if rids is None else rids[start:end],
                    what,
                )
            )
        per_chunk = await _gather_or_cancel(tasks)
        return [out for outputs in per_chunk for out in outputs]

    async def _generate_chunk(self, prompts, params, n, fields, rids, what) -> list[GenerateOutput]:
        """One batched /generate; its retries resend the whole chunk."""
        payload = {"input_ids": prompts, "sampling_params": params, **fields, **self._adapter()}
        if rids is not None:
            payload["rid"] = rids
        body = await self._json("POST", "/generate", payload, what)
        items = body if isinstance(body, list) else [body]
        if len(items) != len(prompts) * n:
            raise RolloutRequestError(
                f"{self.base_url}/generate answered {len(items)} outputs for {what}; expected "
                f"{len(prompts) * n} ({len(prompts)} prompts x n={n}). If this server does not implement "
                "SGLang's batched /generate (a list of input_ids), use RolloutClient(batched=False)"
            )
        return [GenerateOutput.from_response(item) for item in items]

    def score(
        self,
        sequences: list[list[int]],
        starts: list[int],
        temperature: float = 1.0,
        return_routed_experts: bool = False,
    ) -> list[tuple]:
        """Teacher-forced log-probs under the weights the server holds now: for each sequence, the
        log-prob of every token from starts[i] on (one prefill; nothing is sampled), with the
        weight_version that computed them (trainer/parity.py's check of a weight sync): a
        (log-probs, version) pair per sequence, and with `return_routed_experts` its MoE routing
        record third (SGLang's base64, len(sequence) - 1 tokens; megarl/wire/routing.py)."""
        return self._run(self._score(sequences, starts, temperature, return_routed_experts))

    def score_later(
        self,
        sequences: list[list[int]],
        starts: list[int],
        temperature: float = 1.0,
        return_routed_experts: bool = False,
    ):
        """`score`, sent now and answered through the returned concurrent Future (the caller
        works meanwhile)."""
        return self._submit(self._score(sequences, starts, temperature, return_routed_experts))

    async def _score(self, sequences, starts, temperature, return_routed_experts=False) -> list[tuple]:
        payload = {
            "input_ids": sequences,
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
            "logprob_start_len": list(starts),
            **_fields(True, return_routed_experts),
            **self._adapter(),
        }
        body = await self._json("POST", "/generate", payload, f"scoring {len(sequences)} sequences")
        items = body if isinstance(body, list) else [body]
        if len(items) != len(sequences):
            raise RolloutRequestError(f"{self.base_url}/generate scored {len(items)} of {len(sequences)} sequences")
        out = []
        for item in items:
            meta = item.get("meta_info", {})
            lps = [float("nan") if t[0] is None else float(t[0]) for t in meta.get("input_token_logprobs") or []]
            routed = (meta.get("routed_experts"),) if return_routed_experts else ()
            out.append((lps, meta.get("weight_version"), *routed))
        return out

    def generate_text(self, texts: list[str], sampling_params: dict | None = None) -> list[GenerateOutput]:
        """One /generate with SGLang's `text` input (the server tokenizes), for callers without the
        server's tokenizer (a judge model, megarl.reward.genrm): len(texts) * n outputs, in order."""
        return self._run(self._generate_text(list(texts), dict(sampling_params or {})))

    async def _generate_text(self, texts: list[str], params: dict) -> list[GenerateOutput]:
        if not texts:
            return []
        what = f"{len(texts)} text prompt(s) (sampling_params={params})"
        body = await self._json("POST", "/generate", {"text": texts, "sampling_params": params}, what)
        items = body if isinstance(body, list) else [body]
        expected = len(texts) * _samples_per_prompt(params)
        if len(items) != expected:
            raise RolloutRequestError(
                f"{self.base_url}/generate answered {len(items)} outputs for {what}; expected {expected}"
            )
        return [GenerateOutput.from_response(item) for item in items]


async def _gather_or_cancel(coros: list) -> list:
    """asyncio.gather, but the first failure cancels the other requests: the call fails anyway, and
    a cancelled request disconnects, which tells the server to stop generating for it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _fields(return_logprob: bool, return_routed_experts: bool) -> dict:
    """The /generate body's flags; return_routed_experts only when asked, so other requests stay
    what they were for servers that predate the field."""
    return {"return_logprob": return_logprob, **({"return_routed_experts": True} if return_routed_experts else {})}


def _images(images: list | None, start: int, end: int, batched: bool = False) -> dict:
    """The `image_data` field of prompts start..end-1 (a list per prompt when batched), or none
    when they have no images: a text request stays what it was."""
    if images is None or not any(images[start:end]):
        return {}
    return {"image_data": [list(x or []) for x in images[start:end]] if batched else list(images[start])}


def _samples_per_prompt(params: dict) -> int:
    return int(params.get("n", 1) or 1)


def _describe_batch(prompts: list[list[int]], params: dict | list[dict], start: int, total: int) -> str:
    """Names a batched request in errors: its size, where it sits in the call, its sampling params."""
    where = "" if len(prompts) == total else f" (prompts {start}..{start + len(prompts) - 1} of {total})"
    tokens = sum(len(p) for p in prompts)
    if isinstance(params, dict):
        shown = f"sampling_params={params}"
    elif all(p == params[0] for p in params):
        shown = f"sampling_params={params[0]} for each prompt"
    else:
        shown = f"per-prompt sampling_params, the first {params[0]}"
    return f"a batch of {len(prompts)} prompts{where} ({tokens} tokens, {shown})"


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:1000]
    if isinstance(body, dict):
        error = body.get("error")
        return str(error.get("message") if isinstance(error, dict) else body.get("message") or body)[:1000]
    return str(body)[:1000]
