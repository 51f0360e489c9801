"""Worker: the base class of one SPMD rank in a worker group.

A RayWorkerGroup constructs every rank as `worker_cls(*init_args, rank=, world_size=, master_addr=,
master_port=, **init_kwargs)`, then calls `init_distributed()` on all ranks at once and collects
`get_mesh_coord()`. Subclasses forward the keyword-only distributed arguments:

    class Actor(Worker):
        def __init__(self, config, **dist):
            super().__init__(**dist)
            self.config = config

        def init_distributed(self):
            super().init_distributed()          # torch.distributed world
            ...                                 # Megatron parallel_state.initialize_model_parallel

        def get_mesh_coord(self) -> MeshCoord:  # read back from parallel_state
            ...

The class does not depend on Ray, so the same worker runs under torchrun or multiprocessing.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megarl.controller.dispatch import MeshCoord
from megarl.procs.net import get_node_ip  # noqa: F401  (also imported from here)

NUM_THREADS_ENV = "MEGARL_NUM_THREADS"
DEFAULT_PROCESS_GROUP_TIMEOUT_S = 1800.0


class Worker:
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        master_addr: str | None = None,
        master_port: int | None = None,
        num_threads: int | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"{type(self).__name__}: rank={rank} is outside [0, world_size={world_size})")
        if (master_addr is None or master_port is None) and rank != 0:
            raise ValueError(
                f"{type(self).__name__} rank {rank}: master_addr/master_port are required for every rank "
                f"except 0 (rank 0 picks them on its own node); got {master_addr!r}:{master_port!r}"
            )
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr if master_addr is not None else get_node_ip()
        # rank 0 picking the rendezvous: its store listens from now on, on a port the OS chose, so
        # no other process can take the port between choosing it and binding it (seen: a port
        # probed free at construction was taken by the time every rank joined, EADDRINUSE)
        self._store = None
        if master_port is None:
            self._store = dist.TCPStore(
                self.master_addr,
                0,
                world_size,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=DEFAULT_PROCESS_GROUP_TIMEOUT_S),
            )
            master_port = self._store.port
        self.master_port = master_port
        torch.set_num_threads(resolve_num_threads(num_threads))

    def get_master_addr_port(self) -> tuple[str, int]:
        """Where the other ranks rendezvous (asked of rank 0 by the worker group)."""
        return self.master_addr, self.master_port

    def get_node_ip(self) -> str:
        return get_node_ip()

    def process_info(self) -> dict:
        """Where this rank runs: its pid and node (named when it dies)."""
        return {"pid": os.getpid(), "node": get_node_ip()}

    def init_distributed(self) -> None:
        """Hook called on all ranks at once after construction; engines extend it (Megatron)."""
        self.init_process_group()

    def init_process_group(
        self, backend: str | None = None, timeout_s: float = DEFAULT_PROCESS_GROUP_TIMEOUT_S
    ) -> None:
        """Join the torch.distributed world of this group.

        backend None picks gloo on CPU and "cpu:gloo,cuda:nccl" when this process sees a GPU, so
        CPU-side collectives (object gathers, barriers) keep working next to NCCL.
        """
        if dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} rank {self.rank}: torch.distributed is already initialized")
        if backend is None:
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if "nccl" in backend:
            # Ray exposes only this actor's GPUs, so its GPU is device 0; torchrun sets LOCAL_RANK.
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # Megatron and TransformerEngine read these from the environment.
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )
        timeout = datetime.timedelta(seconds=timeout_s)
        if self._store is None:  # rank 0 given its port serves it here; the others join rank 0's
            self._store = dist.TCPStore(self.master_addr, self.master_port, self.world_size, self.rank == 0, timeout)
        self._store.set_timeout(timeout)
        dist.init_process_group(
            backend=backend, store=self._store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )

    def get_mesh_coord(self) -> MeshCoord:
        """Default mesh: pure data parallel. Megatron engines override this from parallel_state."""
        return MeshCoord(rank=self.rank, dp_rank=self.rank, dp_size=self.world_size)


def resolve_num_threads(num_threads: int | None) -> int:
    """Explicit value, else $MEGARL_NUM_THREADS, else 1 (ranks share the node's cores)."""
    if num_threads is None:
        raw = os.environ.get(NUM_THREADS_ENV, "1")
        try:
            num_threads = int(raw)
        except ValueError:
            raise ValueError(f"${NUM_THREADS_ENV}={raw!r} is not an integer") from None
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    return num_threads
