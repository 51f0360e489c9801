"""Client for a remote reward endpoint: rows go out in batches over HTTP, scores come back.

The JSON contract (megarl.reward.serve implements it around any megarl reward function):

    POST <reward.model.url>
    {"rows": [{"data_source": "megarl/digits",       # the row's data_source
               "prompt": "382",                      # the prompt as text (chat messages' content)
               "messages": [{"role": "user", "content": "382"}],   # the prompt as chat messages
               "response": "2",                      # the policy's response text
               "ground_truth": "2",
               "extra_info": {...}}, ...]}           # the dataset row's extra_info (JSON)

    200 {"scores": [1.0, null, ...],                 # one per row, in order: a finite number or null
         "errors": [null, "why row 1 failed", ...]}  # optional; a null score's reason

A null score, a non-finite or non-numeric one, or an answer of the wrong length is a failure of
that row (or of every row of the batch). 4xx answers are the client's mistake: not retried.
Connection errors, timeouts and 5xx answers are retried with exponential backoff, up to
`max_retries` times per batch; then every row of the batch fails. Failures are returned as
`Failure`s, never as 0: the caller (model.RowScorer) raises a RewardError naming the row and
its data_source, or scores it reward.model.fallback_score and counts it.

`api_key` (default: the MEGARL_REWARD_API_KEY environment variable) is sent as `Authorization:
Bearer KEY`. The rollout engines' key is never sent here: this endpoint may be a third party's.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import threading
import time
from dataclasses import dataclass

import httpx

API_KEY_ENV = "MEGARL_REWARD_API_KEY"


@dataclass(frozen=True)
class Failure:
    """A row the model could not score; `reason` says why (shown in errors and warnings)."""

    reason: str
    unparsable: bool = False  # genrm: the judge answered, but no score could be read from it


def jsonable(value):
    """json.dumps `default`: numpy scalars and arrays (parquet extra_info) as Python values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


class RemoteReward:
    """Scores rows with a remote endpoint, `batch_size` rows per POST, up to `concurrency` POSTs
    in flight. Thread-safe: the overlap scorer calls it from several threads."""

    kind = "remote"

    def __init__(
        self,
        url: str,
        *,
        batch_size: int = 64,
        concurrency: int = 4,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        api_key: str | None = None,
    ):
        if batch_size < 1 or concurrency < 1 or timeout_s <= 0 or max_retries < 0:
            raise ValueError(
                f"RemoteReward needs batch_size, concurrency >= 1, timeout_s > 0 and "
                f"max_retries >= 0; got {batch_size}, {concurrency}, {timeout_s}, {max_retries}"
            )
        self.url, self.batch_size, self.max_retries = url, batch_size, max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            headers=headers,
            limits=httpx.Limits(max_connections=concurrency),
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="remote-reward")
        self._lock = threading.Lock()
        self.retries = 0  # POSTs re-sent (transport errors, timeouts, 5xx)

    def score(self, rows: list[dict]) -> list[float | Failure]:
        """One score or Failure per row, in order. `rows`: dicts with the contract's row fields."""
        batches = [rows[k : k + self.batch_size] for k in range(0, len(rows), self.batch_size)]
        if len(batches) <= 1:
            return self._batch(batches[0]) if batches else []
        return [s for part in self._pool.map(self._batch, batches) for s in part]

    def take_stats(self) -> dict[str, float]:
        with self._lock:
            retries, self.retries = self.retries, 0
        return {"reward/model_retries": float(retries)}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def _batch(self, rows: list[dict]) -> list[float | Failure]:
        body = json.dumps({"rows": rows}, default=jsonable).encode()
        last_error = ""
        for attempt in range(self.max_retries + 1):
            try:
                response = self._http.post(self.url, content=body)
                if response.status_code < 500:
                    break
                last_error = f"HTTP {response.status_code}: {response.text[:300]}"
            except httpx.TransportError as exc:  # connect/read errors and timeouts
                last_error = f"{type(exc).__name__}: {exc or 'no detail'}"
            if attempt < self.max_retries:
                with self._lock:
                    self.retries += 1
                time.sleep(min(self.backoff_s * 2**attempt, self.max_backoff_s))
        else:
            tries = self.max_retries + 1
            return [
                Failure(
                    f"POST {self.url} failed {tries} time(s) for a batch of {len(rows)} rows; last error: {last_error}"
                )
            ] * len(rows)
        if response.status_code >= 400:
            return [
                Failure(
                    f"POST {self.url} rejected a batch of {len(rows)} rows: HTTP "
                    f"{response.status_code}: {response.text[:300]}"
                )
            ] * len(rows)
        return parse_answer(response, len(rows), self.url)


def parse_answer(response: httpx.Response, n: int, url: str) -> list[float | Failure]:
    """The contract's answer -> one float or Failure per row."""
    try:
        body = response.json()
    except ValueError:
        return [Failure(f"{url} answered something other than JSON: {response.text[:200]!r}")] * n
    scores = body.get("scores") if isinstance(body, dict) else None
    errors = body.get("errors") if isinstance(body, dict) else None
    if not isinstance(scores, list) or len(scores) != n:
        got = f"{len(scores)} scores" if isinstance(scores, list) else f"{str(body)[:200]!r}"
        return [Failure(f'{url} answered {got} for a batch of {n} rows; expected {{"scores": [{n} numbers]}}')] * n
    if not isinstance(errors, list) or len(errors) != n:
        errors = [None] * n
    out: list[float | Failure] = []
    for value, error in zip(scores, errors):
        if value is None:
            out.append(Failure(f"the endpoint could not score it: {error or 'null score, no reason given'}"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append(float(value))
        else:
            out.append(Failure(f"the endpoint answered {value!r}, not a finite number"))
    return out
