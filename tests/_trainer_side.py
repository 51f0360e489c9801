"""The trainer's side of the weight-update protocol, played by tests: form an update group with
running engines, broadcast full tensors (distributed), plan and send reshard messages.

Group layout as the trainer lays it out: the sending trainer ranks first (0..n-1), then every
engine's TP ranks, engine by engine (engine e has rank_offset = n + the earlier engines' tp).
Sender ranks live in threads of the test process; each has its own store connection (one
TCPStore client blocks on one wait at a time, so two ranks sharing it never finish joining).
"""

from __future__ import annotations

import concurrent.futures
import itertools

import torch

from megarl.wire.update_group import host_store, join_update_group, new_update_group

TRAINER_TIMEOUT_S = 60.0  # a test that leaves a sender waiting fails after this, instead of hanging


class TrainerGroup:
    """`n_senders` trainer ranks of update group `name` with the engines `clients` ({key: (client, tp)})."""

    def __init__(self, name: str, engines: dict, n_senders: int = 1):
        self.name, self.engines, self.n_senders = name, engines, n_senders
        self.offsets, offset = {}, n_senders
        for key, (_, tp) in engines.items():
            self.offsets[key] = offset
            offset += tp
        self.world_size = offset
        self.store = host_store("127.0.0.1", TRAINER_TIMEOUT_S)
        self.senders = []

    def form(self, pool: concurrent.futures.Executor, extra_senders=()) -> dict:
        """Engines join over HTTP while the sender ranks (except those in `extra_senders`, which join
        on their own, e.g. from another process) join here. Returns the engines' answers."""
        inits = {
            key: pool.submit(
                client.init_weights_update_group,
                "127.0.0.1",
                self.store.port,
                self.offsets[key],
                self.world_size,
                self.name,
            )
            for key, (client, _) in self.engines.items()
        }
        joins = [pool.submit(self._join, rank) for rank in range(self.n_senders) if rank not in extra_senders]
        self.senders = [f.result() for f in joins]
        return {key: f.result() for key, f in inits.items()}

    def _join(self, rank: int):
        if rank == 0:
            return new_update_group(self.store, self.name, 0, self.world_size, timeout_s=TRAINER_TIMEOUT_S)
        return join_update_group(
            "127.0.0.1", self.store.port, rank, self.world_size, self.name, timeout_s=TRAINER_TIMEOUT_S
        )

    def close(self) -> None:
        for group in self.senders:
            group.destroy()
        self.senders = []


def distributed_request(named: list[tuple[str, torch.Tensor]]) -> tuple[list, list, list]:
    return (
        [n for n, _ in named],
        [str(t.dtype).removeprefix("torch.") for _, t in named],
        [list(t.shape) for _, t in named],
    )


def broadcast_full(group, named: list[tuple[str, torch.Tensor]], load_format: str | None) -> None:
    """What SGLang's trainer sends: one broadcast per tensor, or all bytes back to back in one."""
    if load_format is None:
        for _, tensor in named:
            group.broadcast(tensor.contiguous(), src=0).wait()
        return
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in named])
    group.broadcast(flat, src=0).wait()


def plan_reshard(
    layouts: dict,
    offsets: dict,
    new: dict[str, torch.Tensor],
    n_senders: int = 2,
    messages_per_pair: int = 3,
    wide: tuple[str, ...] = (),
) -> tuple[dict, dict]:
    """Every engine rank's local shard of each tensor in `new`, cut in two boxes along dim 0, the
    halves sent by different senders, packed into `messages_per_pair` messages per (sender, engine
    rank). The first message of each pair starts with a 2-byte gap, so its float entries sit at
    offsets their dtype is not aligned to; names in `wide` travel as float64 (cast by the engine).

    Returns (sends: {sender: [(dst group rank, tag, uint8 tensor)]}, bodies: {engine: ranks list}).
    """
    sends, bodies, tags = {s: [] for s in range(n_senders)}, {}, itertools.count(100)
    for key, layout in layouts.items():
        bodies[key] = []
        for info in layout["ranks"]:
            pieces = {s: [] for s in range(n_senders)}
            for name, full in new.items():
                spec = info["params"][name]
                local = (
                    full
                    if spec["dim"] is None
                    else full.narrow(spec["dim"], spec["range"][0], spec["range"][1] - spec["range"][0])
                )
                rows = local.shape[0]
                for s, (a, b) in enumerate([(0, rows // 2), (rows // 2, rows)]):
                    box = [[a, b]] + [[0, d] for d in local.shape[1:]]
                    pieces[s % n_senders].append((name, box, local[a:b], torch.float64 if name in wide else None))
            messages = []
            for s, listed in pieces.items():
                for m in range(min(messages_per_pair, len(listed))):
                    tag = next(tags)
                    data, entries = _pack(listed[m::messages_per_pair], gap=2 if m == 0 else 0)
                    sends[s].append((offsets[key] + info["rank"], tag, data))
                    messages.append({"src": s, "tag": tag, "nbytes": data.numel(), "entries": entries})
            bodies[key].append(messages)
    return sends, bodies


def _pack(pieces, gap: int) -> tuple[torch.Tensor, list[dict]]:
    chunks, entries, offset = [torch.zeros(gap, dtype=torch.uint8)], [], gap
    for name, box, values, dtype in pieces:
        raw = values.to(dtype or values.dtype).contiguous().reshape(-1).view(torch.uint8)
        entries.append(
            {"name": name, "dtype": str(dtype or values.dtype).removeprefix("torch."), "box": box, "offset": offset}
        )
        chunks.append(raw)
        offset += raw.numel()
    return torch.cat(chunks), entries


def send_all(group, sends: list[tuple[int, int, torch.Tensor]]) -> None:
    """Post every send, then wait for all (the receivers post all their receives first too)."""
    works = [group.send(data, dst, tag) for dst, tag, data in sends]
    for work in works:
        work.wait()
