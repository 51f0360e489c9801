"""fully_async's rollout producer: the engines generate continuously; the trainer takes batches.

A thread runs an asyncio loop that keeps sending prompts (one /generate per prompt with its n
samples, through the router when there is one, else round-robin over the live engines) while
admission allows, and puts every finished group into a buffer tagged with the trainer version
that was current when it was sent. `take()` hands the trainer the first `groups_per_step` groups
to finish (completion order: short answers do not wait for long ones).

Staleness. A group sent under version v and trained at version u is u - v versions old.
Admission (AReaL's rule) lets the producer have sent at most (u - u0 + max_staleness + 1) *
groups_per_step groups, not counting dropped ones, by the time the trainer holds version u (u0:
its version when the producer started), so the buffer never runs more than max_staleness
steps ahead; and never more than the remaining steps will train (nothing is generated only to
be aborted at the end of the run). A group that still comes out older (a long answer that finished late) is dropped
at `take()` and counted (async/dropped_stale): the bound holds for every trained row.

Weight updates happen while requests are in flight: the trainer's sync pauses the engines
(trainer.pause_mode), updates them and lets them continue, so a response may span two versions;
each token's log-prob is that of the weights that produced it (the engines record it per token,
meta_info["weight_versions"], SGLang's spans of output tokens). `async/partial_frac` is the fraction
of rows whose tokens span versions. With routing replay (actor.moe.routing_replay) every request
also asks for the MoE experts of each token, to the engines directly (sglang-router drops the
field); a resumed answer keeps each part's records (client/partial.py).

Failures: the client retries a request (rollout.max_retries). One that still fails makes the
fleet look for dead engines (RolloutFleet.recover: a dead one leaves service and restarts in the
background, or is waited for when none is left) and the prompt is sent again, to a live engine,
under the current version (`async/resent`; counted in rollout/retries); a restarted engine gets
the actor's weights before it serves (Trainer._resync), at the latest at the next sync. A request
that fails twice with no engine found dead, or MAX_RESENDS times, stops the producer and `take()`
raises it: no prompt is dropped silently, none is trained twice. An answer aborted
mid-generation is a normal event: it is continued from its tokens (partial rollout, `async/resumed`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time

import numpy as np

from megarl.data.batch import Batch
from megarl.rollout.client.manager import SamplingSpec, rows_to_batch
from megarl.rollout.client.partial import is_partial, resume_partial

MAX_RESUMES = 16  # times one answer may be aborted and continued before the producer gives up
MAX_RESENDS = 4  # times one prompt's request may fail (engines dying) before the producer gives up


@dataclasses.dataclass
class _Group:
    prompt: Batch  # the prompt's row (non-tensor columns)
    prompt_ids: list[int]
    outputs: list  # n GenerateOutputs
    version: int  # trainer version when it was sent


class RolloutProducer:
    def __init__(
        self,
        runtime,
        batches,
        cursor: int,
        sampling: SamplingSpec,
        *,
        groups_per_step: int,
        max_staleness: int,
        version: int,
        steps: int | None = None,
        make_client=None,
    ):
        """`steps`: how many batches the trainer will take (None: no end); the producer sends no
        group that no step would train. `make_client(url)`: the client for one engine or router
        URL (default: a RolloutClient)."""
        self.rt, self.batches, self.sampling = runtime, batches, dataclasses.replace(sampling, seed=None)
        self.groups_per_step, self.max_staleness = groups_per_step, max_staleness
        self._routed = sampling.return_routed_experts  # actor.moe.routing_replay
        self.max_groups = None if steps is None else steps * groups_per_step
        self._cond = threading.Condition()
        self._version = self._version0 = version
        self._buffer: list[_Group] = []
        self._sent = self._dropped = self._resumed = self._resent = self._retries_reported = 0
        self._reported = (0, 0, 0)  # dropped, resumed, resent as of the last take(): a step's own counts
        self._error: BaseException | None = None
        self._stopping = False
        self._prompts = self._prompt_stream(cursor)
        self._clients: dict[str, object] = {}
        self._make_client = make_client or self._rollout_client
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()
        self._ready.wait()

    # ---- the trainer's side ----------------------------------------------------------------------
    def take(self, version: int, timing: dict) -> tuple[Batch, dict]:
        """The next `groups_per_step` groups trained at `version`, as rows (prompt-major), and the
        step's async/* stats. Blocks until enough have finished (perf/wait_s)."""
        t0 = time.perf_counter()
        with self._cond:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"fully_async rollout failed: {self._error}") from self._error
                fresh = [g for g in self._buffer if version - g.version <= self.max_staleness]
                if len(fresh) < len(self._buffer):
                    self._dropped += len(self._buffer) - len(fresh)
                    self._buffer = fresh
                    self._notify()  # dropped groups free admission
                if len(self._buffer) >= self.groups_per_step:
                    groups = self._buffer[: self.groups_per_step]
                    del self._buffer[: self.groups_per_step]
                    break
                self._cond.wait(timeout=1.0)
            dropped_before, resumed_before, resent_before = self._reported
            self._reported = (self._dropped, self._resumed, self._resent)
            stats = {
                "async/dropped_stale": float(self._dropped - dropped_before),
                "async/resumed": float(self._resumed - resumed_before),  # aborted answers continued
                "async/resent": float(self._resent - resent_before),  # prompts sent again (failures)
                "async/buffered_groups": float(len(self._buffer)),
                "async/sent_groups": float(self._sent),
            }
        timing["perf/wait_s"] = time.perf_counter() - t0
        rows = self._rows(groups)
        stats["async/group_staleness_max"] = float(max(version - g.version for g in groups))
        spans = [_spans(out, g) for g in groups for out in g.outputs]
        stats["async/partial_frac"] = sum(spans) / len(spans)
        retries = sum(c.retries for c in self._clients.values())  # the clients' counts: since they began
        stats["rollout/retries"] = float(retries - self._retries_reported) + stats["async/resent"]
        self._retries_reported = retries
        return rows, stats

    def set_version(self, version: int) -> None:
        """The trainer synced `version` to the engines: admission moves on."""
        with self._cond:
            self._version = version
            self._notify()

    def stop(self) -> None:
        """Stop sending, abort what is in flight (the engines answer it at once), join."""
        with self._cond:
            self._stopping = True
            self._notify()
        self.rt.fleet.abort_all_requests()
        self._thread.join(timeout=60)
        for client in self._clients.values():
            client.close()

    # ---- the producer thread ---------------------------------------------------------------------
    def _admitted(self) -> bool:
        allowed = (self._version - self._version0 + self.max_staleness + 1) * self.groups_per_step
        if self.max_groups is not None:  # the last steps: what is in flight then is all they need
            allowed = min(allowed, self.max_groups)
        return self._sent - self._dropped < allowed

    def _notify(self) -> None:
        self._cond.notify_all()
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001  (handed to the trainer by take())
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    async def _main(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                with self._cond:
                    if self._stopping or self._error is not None:
                        break
                    admitted = self._admitted()
                    if admitted:
                        self._sent += 1
                        version = self._version
                if admitted:
                    task = asyncio.create_task(self._one(next(self._prompts), version))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    task.add_done_callback(self._failed)
                    continue
                self._wake.clear()
                with self._cond:
                    if self._admitted() or self._stopping:
                        continue
                await self._wake.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _failed(self, task: asyncio.Task) -> None:
        """A request's task ended with an error it did not hand over itself (the fleet's recovery
        raised): take() raises it; the prompt is not dropped silently."""
        if not task.cancelled() and task.exception() is not None:
            with self._cond:
                if self._error is None and not self._stopping:
                    self._error = task.exception()
                self._cond.notify_all()

    async def _one(self, prompt: tuple[Batch, list[int]], version: int) -> None:
        row, ids = prompt
        for attempt in range(MAX_RESENDS + 1):
            client = self._client()
            try:
                routed = {"return_routed_experts": True} if self._routed else {}
                outputs = await client.agenerate([ids], self.sampling.to_sglang(), return_logprob=True, **routed)
                outputs = await self._resume_aborted(client, ids, outputs)
                break
            except Exception as exc:  # noqa: BLE001  (sent again after a dead engine, else raised)
                if self._stopping or attempt == MAX_RESENDS or not await self._engine_replaced(attempt):
                    with self._cond:
                        if not self._stopping and self._error is None:
                            self._error = exc
                        self._cond.notify_all()
                    return
                with self._cond:
                    self._resent += 1
                    version = self._version  # generated again: under the engines' current weights
        aborted = [o for o in outputs if o.finish_reason.get("type") == "abort"]
        with self._cond:
            if aborted and not self._stopping and self._error is None:
                self._error = RuntimeError(f"an engine aborted a request: {aborted[0].finish_reason}")
            elif not aborted:
                self._buffer.append(_Group(row, ids, outputs, version))
            self._cond.notify_all()

    async def _engine_replaced(self, attempt: int) -> bool:
        """A request failed: the fleet takes dead engines out of service and restarts them (on a
        thread: Ray calls block). True to send it again: an engine was dead, or it is the
        request's first failure (another request may have found the dead engine first)."""
        dead = await asyncio.to_thread(self.rt.fleet.recover)
        return bool(dead) or attempt == 0

    async def _resume_aborted(self, client, ids: list[int], outputs: list) -> list:
        """Answers aborted mid-generation (an engine that pauses for a weight update by aborting, as
        SGLang's abort mode does) are continued from their tokens under the weights the engine
        holds now (client/partial.py): nothing generated is lost, each token keeps the log-prob and
        the version that produced it. Not while the producer stops (stop() aborts on purpose)."""
        params, done = {**self.sampling.to_sglang(), "n": 1}, []
        for out in outputs:
            for _ in range(MAX_RESUMES):
                if not is_partial(out) or self._stopping:
                    break
                out = await resume_partial(
                    client, ids, params, out, **({"return_routed_experts": True} if self._routed else {})
                )
                with self._cond:
                    self._resumed += 1
            else:
                if is_partial(out):
                    raise RuntimeError(f"an answer was aborted {MAX_RESUMES} times in a row: {out.finish_reason}")
            done.append(out)
        return done

    def _prompt_stream(self, cursor: int):
        for k in itertools.count(cursor):
            batch = self.batches.batch_at(k)
            keys = list(batch.non_tensors)
            for i in range(len(batch)):
                yield batch[i : i + 1].select(*keys), list(map(int, batch["raw_prompt_ids"][i]))

    def _client(self):
        fleet = self.rt.fleet  # sglang-router drops return_routed_experts: engines directly then
        urls = [fleet.router_url] if fleet.router_url and not self._routed else fleet.live_urls()
        url = urls[self._sent % len(urls)]
        if url not in self._clients:
            self._clients[url] = self._make_client(url)
        return self._clients[url]

    def _rollout_client(self, url: str):
        from megarl.rollout.client.client import RolloutClient

        r = self.rt.cfg.rollout
        return RolloutClient(
            url, batched=False, timeout_s=r.request_timeout_s, max_retries=r.max_retries, api_key=self.rt.fleet.api_key
        )

    def _rows(self, groups: list[_Group]) -> Batch:
        n = self.sampling.n
        rows = rows_to_batch([(g.prompt_ids, out) for g in groups for out in g.outputs], routed_experts=self._routed)
        prompts = Batch.concat([g.prompt for g in groups]).repeat_interleave(n)
        rows["rollout_start_version"] = np.array([_label(g.version) for g in groups for _ in g.outputs], dtype=object)
        return prompts.union(rows)


def _spans(out, group: _Group) -> bool:
    """The row's tokens came from more than one weight version (the engine's per-token record,
    meta_info["weight_versions"]; else: it ended under another version than it was sent under)."""
    runs = out.meta_info.get("weight_versions")
    if runs is not None:
        return len(runs) > 1
    return str(out.meta_info.get("weight_version")) != _label(group.version)


def _label(version: int) -> str:
    """A trainer version as the engines label it (the initial weights are "default")."""
    return str(version) if version else "default"
