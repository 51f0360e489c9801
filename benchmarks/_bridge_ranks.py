"""The processes of bench_bridge.py: spawned gloo ranks, the trainer ranks' sync loop, and the
raw-gloo peers. Kept apart from the driver so spawned processes import only this small module.

Every spawned process runs with one torch thread. Results travel to the parent as torch.save bytes.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import httpx
import torch
import torch.distributed as dist

from megarl.bridge.distributed import DistributedTransport

# (prompt tokens, response tokens): the rows whose log-probs both sides must agree on
SEQ_ROWS = [
    ([2, 10, 11, 12, 3], [13, 14, 1]),
    ([2, 20, 21, 3], [22, 23, 24, 25, 1]),
    ([2, 30, 3], [31]),
    ([2, 40, 41, 42, 43, 44, 3], [45, 46]),
]
LAYOUTS = {"ep2": dict(tp=1, ep=2, pp=1), "pp2": dict(tp=1, ep=1, pp=2)}


# ---- the trainer: a real 2-rank Megatron engine ---------------------------------------------------
def make_rows():
    from megarl.data.batch import Batch

    width, rlen = max(len(p) + len(r) for p, r in SEQ_ROWS), max(len(r) for _, r in SEQ_ROWS)
    ids = torch.zeros(len(SEQ_ROWS), width, dtype=torch.long)
    resp = torch.zeros(len(SEQ_ROWS), rlen, dtype=torch.long)
    mask = torch.zeros(len(SEQ_ROWS), rlen)
    for i, (p, r) in enumerate(SEQ_ROWS):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        resp[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1) * mask
    return Batch(
        {
            "input_ids": ids,
            "responses": resp,
            "response_mask": mask,
            "prompt_lengths": torch.tensor([len(p) for p, _ in SEQ_ROWS]),
            "advantages": advantages,
        }
    )


def build_engine(model_path, tp: int, ep: int, pp: int):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    engine = MegatronEngine(
        EngineSpec(
            model_path=str(model_path),
            parallel=ParallelConfig(tp=tp, ep=ep, pp=pp, sequence_parallel=tp > 1),
            optim=OptimConfig(lr=1e-3, adam_eps=1e-2, clip_grad=0.0),
            micro_batch_size=2,
            seed=1,
        )
    )
    engine.initialize()
    return engine


def step_and_score(engine, rows) -> torch.Tensor:
    """One real optimizer step (every weight moves), then the trainer's log-probs of the rows, on
    every rank (only the last pipeline stage computes them)."""
    engine.train_mini_batch(rows, lambda lp, ent, mb: ((lp * mb["advantages"]).sum(), mb["response_mask"].sum(), {}))
    out = engine.compute_log_prob(rows)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if out is None else out["log_probs"])
    return next(lp for lp in everyone if lp is not None)


def engine_logprobs(url: str, like: torch.Tensor) -> torch.Tensor:
    """The engine's log-prob of every response token (prefill only: one batched /generate)."""
    body = {
        "input_ids": [p + r for p, r in SEQ_ROWS],
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
    }
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    response.raise_for_status()
    out = torch.zeros_like(like)
    for i, ((prompt, resp), item) in enumerate(zip(SEQ_ROWS, response.json())):
        triples = item["meta_info"]["input_token_logprobs"]
        for j in range(len(resp)):
            out[i, j] = triples[len(prompt) + j][0]
    return out


def logprob_error(url: str, trainer: torch.Tensor, mask: torch.Tensor) -> float:
    return (engine_logprobs(url, trainer) - trainer)[mask].abs().max().item()


class _RankZeroFunnel:
    """A weight source seen through the rank-0 funnel: rank 0 sends the whole model from
    export_weights() (EP gathers, PP broadcasts to every rank); the other ranks take part in those
    collectives and send nothing."""

    def __init__(self, source, rank: int):
        self.source, self.rank = source, rank

    def sends_owned_weights(self) -> bool:
        return self.rank == 0

    def export_owned_weights(self):
        return self.source.export_weights()


class RankZeroFunnelTransport(DistributedTransport):
    """The shipped distributed transport with one sender (trainer rank 0), for comparison only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._generation = 1000  # its update groups' names stay apart from the shipped transport's

    def _sync(self, source, version, urls):
        return super()._sync(_RankZeroFunnel(source, self.rank), version, urls)


def _record_buckets(transport, sizes: list) -> None:
    """Log the payload bytes of every bucket a distributed sender broadcasts (for the peer)."""
    original = transport._post_bucket

    def post(bucket, version):
        sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        return original(bucket, version)

    transport._post_bucket = post


CONTROL_CALLS = ("pause", "commit", "resume")  # EngineSet calls around the data: pause, commit, continue
PHASES = ("export", *CONTROL_CALLS)


def _time_control_calls(transport, phases: dict) -> None:
    """Add the seconds rank 0 spends in each control call of a sync to `phases` (the rest is data)."""
    engines = transport.engines
    for method in CONTROL_CALLS:

        def timed(*args, _call=getattr(engines, method), _method=method, **kwargs):
            start = time.perf_counter()
            try:
                return _call(*args, **kwargs)
            finally:
                phases[_method] = phases.get(_method, 0.0) + time.perf_counter() - start

        setattr(engines, method, timed)


class TimedSource:
    """The engine as a weight source, adding the seconds rank by rank spent producing weights (export
    generators and piece fetches: TP/EP gathers, PP broadcasts, HF conversion) to phases["export"]."""

    def __init__(self, engine, phases: dict):
        self.engine, self.phases = engine, phases

    def _add(self, start: float) -> None:
        self.phases["export"] = self.phases.get("export", 0.0) + time.perf_counter() - start

    def _timed_iter(self, iterator):
        iterator = iter(iterator)
        while True:
            start = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                self._add(start)
                return
            self._add(start)
            yield item

    def _timed_call(self, fetch):
        def timed():
            start = time.perf_counter()
            try:
                return fetch()
            finally:
                self._add(start)

        return timed

    def export_weights(self):
        return self._timed_iter(self.engine.export_weights())

    def export_owned_weights(self):
        return self._timed_iter(self.engine.export_owned_weights())

    def sends_owned_weights(self) -> bool:
        return self.engine.sends_owned_weights()

    def local_pieces(self) -> list:
        return [dataclasses.replace(p, fetch=self._timed_call(p.fetch)) for p in self.engine.local_pieces()]


def _plan_facts(transport) -> dict:
    plan = transport._plan
    return {
        "messages": [(m.src_rank, m.engine, m.dst_rank, m.tag, m.nbytes) for m in plan.messages],
        "received": {
            f"{e}/{r}": plan.bytes_received(e, r) for e, size in enumerate(plan.engine_sizes) for r in range(size)
        },
        "sent": {r: plan.bytes_sent(r) for r in range(transport.world_size)},
        "payload_total": plan.total_bytes,
        "engine_sizes": list(plan.engine_sizes),
    }


def trainer_rank(rank, model_path, url, layout, blocks, repeats, bucket_bytes, disk_dir, atol):
    """Per block of transports: build them, one untimed warm-up sync each, then `repeats` rounds in
    which each takes a step and a timed sync. Parity is checked after every sync. Rank 0 reports."""
    from megarl.bridge import BridgeSpec, make_transport

    world = dist.get_world_size()
    engine, rows = build_engine(model_path, **LAYOUTS[layout]), make_rows()
    mask = rows["response_mask"].bool()
    report = {"layout": layout, "rows": {}, "buckets": {}, "failures": []}
    trainer_lp = step_and_score(engine, rows)
    if rank == 0:  # the check must have teeth: the engine still serves the checkpoint's weights
        report["stale_err"] = logprob_error(url, trainer_lp, mask)
        if report["stale_err"] <= atol:
            raise RuntimeError(
                f"a stale engine differs by only {report['stale_err']:.2e} <= {atol}: the check "
                "could not catch a sync that delivered nothing"
            )
    version, phases = 0, {}
    source = TimedSource(engine, phases)

    def one_sync(name, transport) -> tuple[float, float | None, dict]:
        nonlocal version, trainer_lp
        version += 1
        trainer_lp = step_and_score(engine, rows)
        phases.clear()
        dist.barrier()
        start = time.perf_counter()
        stats = transport.sync(source, f"{layout}-v{version}", [url])
        elapsed = [None] * world
        dist.all_gather_object(elapsed, time.perf_counter() - start)
        stats = {**stats, "phases": dict(phases)}
        error = logprob_error(url, trainer_lp, mask) if rank == 0 else None
        if error is not None and error > atol:  # reported with the tables (and the exit code), not fatal:
            time.sleep(1.0)  # the timings of the other syncs still stand
            again = logprob_error(url, trainer_lp, mask)
            report["failures"].append(
                f"{layout} {name} sync v{version}: the engine's log-probs differ from the "
                f"trainer's by {error:.2e} > {atol:g} (asked again 1 s later: {again:.2e})"
            )
        return max(elapsed), error, stats

    for block in blocks:
        transports, sizes = {}, {}
        for name in block:
            kind = "distributed" if name == "funnel" else name
            spec = BridgeSpec(kind, (url,), bucket_bytes, disk_dir=str(disk_dir), timeout_s=300)
            cls = RankZeroFunnelTransport if name == "funnel" else None
            transports[name] = cls(spec, rank, world, "127.0.0.1") if cls else make_transport(spec, rank, world)
            _time_control_calls(transports[name], phases)
            if kind == "distributed":
                sizes[name] = []
                _record_buckets(transports[name], sizes[name])
        row = {name: {"times": [], "errors": [], "phases": []} for name in block}
        for name, transport in transports.items():  # warm-up: groups, plans, buffers, first touches
            row[name]["warmup_s"], row[name]["warmup_err"], _ = one_sync(name, transport)
        for _ in range(repeats):
            for name, transport in transports.items():
                for s in sizes.values():
                    s.clear()
                seconds, error, stats = one_sync(name, transport)
                row[name]["times"].append(seconds)
                row[name]["errors"].append(error)
                row[name]["phases"].append({**stats.pop("phases"), "total": seconds})
                row[name]["stats"] = stats
                if name in sizes:
                    everyone = [None] * world
                    dist.all_gather_object(everyone, list(sizes[name]))
                    report["buckets"][name] = everyone
        if "reshard" in transports and rank == 0:
            report["plan"] = _plan_facts(transports["reshard"])
        for transport in transports.values():
            transport.close()
        report["rows"].update(row)
    return report if rank == 0 else None


# ---- raw gloo peers: the same bytes, nothing else ----------------------------------------------------
# `fresh`: buffers are allocated anew every run and senders copy (pack) their bytes into them, as the
# transports do; without it both sides reuse warm preallocated buffers (the raw wire).
def _timed(body, repeats: int) -> list[float]:
    """One untimed warm-up, then `repeats` timed runs of body(), each between two barriers."""
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        body()
        dist.barrier()
        if i:
            times.append(time.perf_counter() - start)
    return times


def _buffer_maker(fresh: bool, nbytes: int, sender: bool):
    """A callable giving the buffer for one run: the same warm one, or a new one (packed if sending)."""
    kept = torch.ones(nbytes, dtype=torch.uint8)
    if not fresh:
        return lambda: kept
    if sender:
        return lambda: torch.empty(nbytes, dtype=torch.uint8).copy_(kept)
    return lambda: torch.empty(nbytes, dtype=torch.uint8)


def _warm_and_fresh(rank: int, run_with, repeats: int):
    """(median s with warm buffers, median s with fresh ones) on rank 0, None elsewhere: both in
    the same process group, one spawn of the ranks for the pair."""
    medians = [statistics.median(_timed(run_with(fresh), repeats)) for fresh in (False, True)]
    return tuple(medians) if rank == 0 else None


def broadcast_peer(rank, buckets: list[int], repeats: int, receivers: int):
    """Rank 0 broadcasts one uint8 buffer per bucket, in turn, to ranks 1..`receivers` (a subgroup
    when the world is larger; the other ranks only meet the timing barriers)."""
    members = list(range(1 + receivers))
    group = dist.new_group(members) if len(members) < dist.get_world_size() else None

    def run_with(fresh: bool):
        makers = [_buffer_maker(fresh, n, rank == 0) for n in buckets] if rank in members else []

        def body():
            for make in makers:
                dist.broadcast(make(), src=0, group=group)

        return body

    return _warm_and_fresh(rank, run_with, repeats)


def p2p_peer(rank, messages: list[tuple[int, int, int, int]], repeats: int):
    """messages: (src, dst, tag, nbytes) in group ranks. Every sender posts all its sends at once,
    every receiver all its receives; then all wait."""

    def run_with(fresh: bool):
        sends = [(dst, tag, _buffer_maker(fresh, n, True)) for src, dst, tag, n in messages if src == rank]
        recvs = [(src, tag, _buffer_maker(fresh, n, False)) for src, dst, tag, n in messages if dst == rank]

        def body():
            works = [dist.isend(make(), dst=dst, tag=tag) for dst, tag, make in sends]
            works += [dist.irecv(make(), src=src, tag=tag) for src, tag, make in recvs]
            for work in works:
                work.wait()

        return body

    return _warm_and_fresh(rank, run_with, repeats)


def gloo_peers(rank, buckets: list[int] | None, messages: list | None, repeats: int, receivers: int) -> dict:
    """Both raw gloo peers in one process group, so the ranks are spawned once for the pair:
    {"distributed": (warm s, fresh s), "reshard": (warm s, fresh s)} on rank 0 for those given."""
    out = {}
    if buckets is not None:
        out["distributed"] = broadcast_peer(rank, buckets, repeats, receivers)
    if messages is not None:
        out["reshard"] = p2p_peer(rank, messages, repeats)
    return out if rank == 0 else None
