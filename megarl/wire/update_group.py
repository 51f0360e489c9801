"""A process group between the trainer and the rollout engines, used only to move weights.

SGLang's `/init_weights_update_group` contract: group rank 0 (a trainer rank) hosts the
rendezvous at `master_address:master_port`; engine rank r joins as `rank_offset + r`. The group is
separate from both sides' own process groups (neither side's default group changes), so it is
built from a store directly and used through the ProcessGroup object's own methods.

gloo on CPU; NCCL on CUDA (written for SGLang parity, not run on this project's CPU machines).
A gloo group that saw an error is broken for good (later calls fail with "pair closure"): every
failure ends the group, and the next sync builds a new one.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0


def host_store(address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Group rank 0: a rendezvous store on a free port of `address` (its port: `store.port`)."""
    return dist.TCPStore(
        address, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def connect_store(address: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    return dist.TCPStore(
        address, int(port), is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


@dataclass
class UpdateGroup:
    name: str
    rank: int
    world_size: int
    backend: str
    pg: dist.ProcessGroup

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Start a broadcast from group rank `src`; returns the Work (call .wait())."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = int(src), 0
        return self.pg.broadcast([tensor], opts)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0):
        return self.pg.send([tensor], int(dst), int(tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0):
        return self.pg.recv([tensor], int(src), int(tag))

    def destroy(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except RuntimeError:  # already broken: nothing left to close
                pass
        self.pg = None


def new_update_group(
    store: dist.Store,
    group_name: str,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> UpdateGroup:
    """Join (blocks until all `world_size` members have joined or the timeout passes)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"weight update group {group_name!r}: rank {rank} outside world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(f"megarl/update_group/{group_name}", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":  # GPU path: SGLang's NCCL weight groups (not run on CPU machines)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        raise ValueError(f"weight update group backend {backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
    return UpdateGroup(group_name, rank, world_size, backend, pg)


def join_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> UpdateGroup:
    """An engine rank's side of /init_weights_update_group."""
    store = connect_store(master_address, master_port, timeout_s)
    return new_update_group(store, group_name, rank, world_size, backend, timeout_s)
