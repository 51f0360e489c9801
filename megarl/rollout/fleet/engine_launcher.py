"""EngineLauncher: the Ray actor that runs one node of one rollout engine where Ray placed it.

One launcher per node of an engine, placed in the engine's resource-pool bundle, so a multi-node
cluster works like a laptop: the driver never spawns servers itself. The launcher starts the
server (the embedded `megarl.rollout.server` or real SGLang) as a subprocess in its own process
group, with its log in the run dir, and can stop or restart it. Node rank 0 of an engine serves
the HTTP API; the other nodes run their ranks and answer /health, so every node is probed alike.
A restart on a free port (rollout.port=0) never gets a port an earlier server of this launcher
had: the old URL may still be known somewhere (a router entry, a kept client).

The API key reaches the server through the environment (embedded) or a 0600 --config file
(SGLang), never through a command line or a log. An embedded server gets the spec's weight
directories (--weight-dirs: where /update_weights_from_disk may read) and body limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megarl.procs.net import free_port
from megarl.rollout.fleet.server_process import RolloutServerProcess

API_KEY_ENV = "MEGARL_ROLLOUT_API_KEY"
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass
class EngineNodeSpec:
    """What one launcher needs to start its node of engine `engine` (picklable, no secrets)."""

    backend: str  # "embedded" | "sglang"
    model_path: str
    engine: int
    node_rank: int = 0
    nnodes: int = 1
    tp: int = 1
    ep: int = 1
    dp: int = 1
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    max_batch_size: int = 256
    torch_threads: int = 1  # the embedded engine's, per rank
    seed: int = 0
    colocated: bool = False  # SGLang: --enable-memory-saver so it can release memory
    mem_fraction_static: float | None = None  # SGLang: --mem-fraction-static (None: its default)
    routed_experts: bool = False  # SGLang: --enable-return-routed-experts (actor.moe.routing_replay)
    # SGLang: --enable-lora --max-lora-rank --lora-target-modules (bridge.transport=adapter): the
    # adapter's rank and the HF module names it adapts (("all",): every module SGLang supports)
    lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = ()
    log_path: str = "rollout_server.log"
    startup_timeout_s: float = 300.0
    env: dict = field(default_factory=dict)
    weight_dirs: tuple = ()  # embedded: --weight-dirs (empty: the server's default, model_path only)
    max_body_mb: float | None = None  # embedded: --max-body-mb (None: the server's default)

    @property
    def name(self) -> str:
        return f"engine{self.engine}" + (f"_node{self.node_rank}" if self.nnodes > 1 else "")


class EngineLauncher:
    def __init__(self, spec: EngineNodeSpec, api_key: str | None = None, gpu_ids: list[str] | None = None):
        self.spec, self._api_key, self.gpu_ids = spec, api_key, list(gpu_ids or [])
        self.server: RolloutServerProcess | None = None
        self._url: str | None = None
        self._used_ports: set[int] = set()  # a restart never comes back on a predecessor's port

    def node_ip(self) -> str:
        from megarl.procs.net import get_node_ip

        return get_node_ip()

    def node_id(self) -> str:
        """The Ray node this launcher (and so its server) runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def dist_init_addr(self) -> str:
        """Where the engine's ranks rendezvous: a free port on this (node rank 0's) node."""
        host = self._reachable_host()
        return f"{host}:{free_port('' if host not in ('127.0.0.1', 'localhost') else host)}"

    def start(self, dist_init_addr: str | None = None) -> str:
        """Start (or restart) this node's server; returns its URL once /health answers."""
        self.stop()
        s = self.spec
        if s.nnodes > 1 and not dist_init_addr:
            raise ValueError(
                f"{s.name}: an engine over {s.nnodes} nodes needs the dist-init address "
                "of node rank 0 (EngineLauncher.dist_init_addr)"
            )
        env = dict(os.environ, **s.env)
        if self._api_key:
            env[API_KEY_ENV] = self._api_key
        if self.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpu_ids)
        if s.backend == "sglang":
            from megarl.rollout.fleet.sglang_process import SGLangServerProcess

            self.server = SGLangServerProcess(s, dist_init_addr, self._api_key, env=env)
        else:
            self.server = RolloutServerProcess(
                s.model_path,
                host=s.host,
                port=s.port,
                max_batch_size=s.max_batch_size,
                seed=s.seed,
                torch_threads=s.torch_threads,
                extra_args=tuple(_mesh_args(s, dist_init_addr) + _limit_args(s)),
                env=env,
                log_path=s.log_path,
                startup_timeout_s=s.startup_timeout_s,
            )
        self.server.avoid_ports = set(self._used_ports)
        self.server.start()
        self._used_ports.add(self.server.port)
        self._url = f"http://{_url_host(self._reachable_host())}:{self.server.port}"
        return self._url

    def url(self) -> str | None:
        return self._url

    def alive(self) -> bool:
        return self.server is not None and self.server.alive()

    def server_pid(self) -> int | None:
        """The server's process id (its process group leader): what a failure test kills."""
        process = self.server.process if self.server is not None else None
        return None if process is None else process.pid

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.server, self._url = None, None

    def _reachable_host(self) -> str:
        return self.node_ip() if self.spec.host in _WILDCARD_HOSTS else self.spec.host


def _mesh_args(spec: EngineNodeSpec, dist_init_addr: str | None) -> list[str]:
    args = []
    if spec.tp > 1:
        args += ["--tp", str(spec.tp)]
    if spec.nnodes > 1:
        args += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank), "--dist-init-addr", dist_init_addr]
    return args


def _limit_args(spec: EngineNodeSpec) -> list[str]:
    args = ["--weight-dirs", ",".join(spec.weight_dirs)] if spec.weight_dirs else []
    return args + (["--max-body-mb", str(spec.max_body_mb)] if spec.max_body_mb is not None else [])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
