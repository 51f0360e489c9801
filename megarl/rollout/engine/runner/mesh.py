"""Start the processes of one TP engine and join them into a mesh, with SGLang's flags.

    python -m megarl.rollout.server --model-path M --tp 2
    python -m megarl.rollout.server --model-path M --tp 4 --nnodes 2 --node-rank 0 --dist-init-addr H:P --port 30000
    python -m megarl.rollout.server --model-path M --tp 4 --nnodes 2 --node-rank 1 --dist-init-addr H:P --port 30001

Node rank R runs global ranks R*L .. R*L+L-1 (L = tp/nnodes). The node's own process is the first
of them and spawns the others as child processes; they stay in its process group, so killing the
group kills them, and they die with it when it alone is killed (lifeline.die_with_parent). Node 0's
first rank is rank 0: the HTTP server and scheduler (server/app.py). Any other node answers only
`/health` on its --port (SGLang's dummy health server on non-zero node ranks: 200 while the node's
process lives; the engine's health is node 0's).

Rendezvous: rank 0 hosts a TCPStore at --dist-init-addr (one node: 127.0.0.1 and a free port); the
process group (gloo on CPU, NCCL on CUDA) and the heartbeats (watchdog.py) use it. The group's
timeout is a year: followers idle inside a broadcast between requests, and a gloo timeout would
break the group for good. Peers that die are caught by the watchdog instead.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist

from megarl.procs import lifeline
from megarl.rollout.engine.runner.channel import CommandChannel
from megarl.rollout.engine.runner.follower import follow
from megarl.rollout.engine.runner.rank import RankWorker
from megarl.rollout.engine.runner.runners import TPRunner
from megarl.rollout.engine.runner.sharding import load_sharded_model, validate_tp
from megarl.rollout.engine.runner.watchdog import PEER_TIMEOUT_S, Watchdog

log = logging.getLogger(__name__)

GROUP_TIMEOUT = datetime.timedelta(days=365)
JOIN_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class MeshSpec:
    tp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    heartbeat_timeout_s: float = PEER_TIMEOUT_S  # silence after which a rank counts as dead

    def __post_init__(self):
        if self.tp < 1 or self.nnodes < 1:
            raise ValueError(f"--tp {self.tp} and --nnodes {self.nnodes} must be >= 1")
        if self.tp % self.nnodes:
            raise ValueError(
                f"--tp {self.tp} must be a multiple of --nnodes {self.nnodes} (each node runs tp/nnodes ranks)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node rank 0's rendezvous address)")
        if self.dist_init_addr:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--dist-init-addr {self.dist_init_addr!r} must look like HOST:PORT")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError(f"--heartbeat-timeout {self.heartbeat_timeout_s} must be > 0 seconds")

    @property
    def ranks_per_node(self) -> int:
        return self.tp // self.nnodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.ranks_per_node

    def store_address(self) -> tuple[str, int]:
        if not self.dist_init_addr:
            return "127.0.0.1", 0  # one node: any free port, passed on to the children
        host, _, port = self.dist_init_addr.rpartition(":")
        return host.strip("[]"), int(port)


def add_mesh_arguments(parser) -> None:
    group = parser.add_argument_group("tensor parallelism (SGLang's flags)")
    group.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1, help="ranks per engine")
    group.add_argument("--nnodes", type=int, default=1, help="nodes one engine spans")
    group.add_argument("--node-rank", type=int, default=0, help="this node's rank; 0 serves HTTP")
    group.add_argument("--dist-init-addr", default=None, help="HOST:PORT of node rank 0's rendezvous")
    group.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=PEER_TIMEOUT_S,
        help="seconds without a heartbeat from a rank before the whole engine exits (megarl's)",
    )


def mesh_spec(args) -> MeshSpec:
    return MeshSpec(args.tp, args.nnodes, args.node_rank, args.dist_init_addr, args.heartbeat_timeout)


@dataclass(frozen=True)
class RankSetup:
    """Everything a rank process needs (picklable: it crosses the spawn boundary)."""

    spec: MeshSpec
    model_path: str
    dtype: str
    device: str
    torch_threads: int
    store_host: str
    store_port: int


class MeshProcess:
    """What one process of the mesh owns: its rank, the child ranks it spawned, its watchdog."""

    def __init__(self, setup: RankSetup, rank: int):
        self.setup, self.rank = setup, rank
        self.children: dict[int, multiprocessing.Process] = {}
        self.watchdog: Watchdog | None = None

    def spawn_children(self) -> None:
        spec, context = self.setup.spec, multiprocessing.get_context("spawn")
        # children die with this process even when it is SIGKILLed (megarl/procs/lifeline.py); the signal is
        # tied to the spawning thread, so only when that is the main thread
        parent = os.getpid() if threading.current_thread() is threading.main_thread() else None
        for rank in range(spec.first_rank + 1, spec.first_rank + spec.ranks_per_node):
            child = context.Process(
                target=_child_main, args=(self.setup, rank, parent), name=f"tp-rank-{rank}", daemon=True
            )
            child.start()
            self.children[rank] = child
        self.watchdog = Watchdog(
            self.setup.store_host,
            self.setup.store_port,
            self.rank,
            spec.tp,
            self.fatal,
            spec.heartbeat_timeout_s,
            self.children,
        ).start()

    def join(self, store) -> RankWorker:
        """Join the process group and load this rank's shard; returns once every rank has."""
        spec = self.setup.spec
        device = torch.device(self.setup.device)
        if device.type == "cuda":
            local = self.rank - spec.first_rank
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
            os.environ["LOCAL_RANK"] = str(local)  # transformers' TP loader reads it
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=dist.PrefixStore("megarl/tp/pg", store),
            rank=self.rank,
            world_size=spec.tp,
            timeout=GROUP_TIMEOUT,
        )
        model, plan, shapes = load_sharded_model(
            self.setup.model_path, getattr(torch, self.setup.dtype), device, spec.tp
        )
        dist.barrier()
        self.watchdog.watch_peers()
        log.info("TP rank %d/%d ready (node rank %d)", self.rank, spec.tp, spec.node_rank)
        return RankWorker(model, plan, shapes, spec.tp, self.rank, device)

    def follow(self, worker: RankWorker) -> None:
        try:
            follow(worker, CommandChannel(worker.device))
        except Exception as exc:  # noqa: BLE001  (fatal: reported, then the process ends)
            self.fatal(f"TP rank {self.rank} lost the mesh: {exc!r}")

    def fatal(self, message: str) -> None:
        """The mesh is broken: end this process and its children now (never wait on a peer)."""
        log.critical("%s; exiting", message)
        for child in self.children.values():
            if child.exitcode is None:
                child.kill()
        os._exit(1)

    def shutdown(self, runner: TPRunner | None = None, timeout_s: float = 30.0) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if runner is not None:
            runner.close()
        for child in self.children.values():
            child.join(timeout_s)
            if child.exitcode is None:
                log.warning("TP rank %s did not exit within %.0fs; killing it", child.name, timeout_s)
                child.kill()


def start_rank0(spec: MeshSpec, model_path: str, dtype: str, device: str, torch_threads: int):
    """Node rank 0: host the rendezvous, spawn this node's other ranks, load rank 0's shard.
    Returns (TPRunner for the engine, MeshProcess for shutdown)."""
    host, port = spec.store_address()
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=JOIN_TIMEOUT)
    process = MeshProcess(RankSetup(spec, model_path, dtype, device, torch_threads, host, store.port), 0)
    process.spawn_children()
    worker = process.join(store)
    return TPRunner(worker, CommandChannel(worker.device), spec.nnodes, on_fatal=process.fatal), process


def run_node(
    spec: MeshSpec, model_path: str, dtype: str, device: str, torch_threads: int, host: str, port: int
) -> None:
    """Node rank R > 0: answer /health, run this node's ranks until rank 0 shuts the engine down."""
    health = _serve_health(host, port, spec.node_rank)
    store_host, store_port = spec.store_address()
    process = MeshProcess(
        RankSetup(spec, model_path, dtype, device, torch_threads, store_host, store_port), spec.first_rank
    )
    process.spawn_children()
    store = dist.TCPStore(store_host, store_port, is_master=False, wait_for_workers=False, timeout=JOIN_TIMEOUT)
    process.follow(process.join(store))
    process.shutdown()
    health.shutdown()


def _child_main(setup: RankSetup, rank: int, parent: int | None = None) -> None:
    if parent is not None:
        lifeline.die_with_parent(parent)
    torch.set_num_threads(setup.torch_threads)  # ranks share the cores; more threads each collapse
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s")
    process = MeshProcess(setup, rank)
    process.watchdog = Watchdog(
        setup.store_host, setup.store_port, rank, setup.spec.tp, process.fatal, setup.spec.heartbeat_timeout_s
    ).start()
    store = dist.TCPStore(
        setup.store_host, setup.store_port, is_master=False, wait_for_workers=False, timeout=JOIN_TIMEOUT
    )
    process.follow(process.join(store))
    process.shutdown()


def validate_model(model_path: str, tp: int) -> None:
    """Refuse a tp the model cannot be split by, before any process starts."""
    from transformers import AutoConfig

    validate_tp(AutoConfig.from_pretrained(model_path), tp)


def _serve_health(host: str, port: int, node_rank: int) -> ThreadingHTTPServer:
    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] in ("/health", "/health_generate"):
                return self._reply(200, b"")
            self._reply(
                404,
                f"node rank {node_rank} of a multi-node engine serves only /health; send requests "
                "to node rank 0".encode(),
            )

        do_POST = do_GET

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # probes every 0.2 s would flood the log
            pass

    server = ThreadingHTTPServer((host, port), Health)
    threading.Thread(target=server.serve_forever, name="node-health", daemon=True).start()
    log.info("node rank %d answers /health on %s:%d", node_rank, host, port)
    return server
