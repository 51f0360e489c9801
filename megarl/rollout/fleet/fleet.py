"""RolloutFleet: the rollout side as a device mesh, seen from the controller.

    fleet = RolloutFleet(engine_specs, pool, placement, api_key=key, router=RouterSpec(...))
    fleet.start()                 # launchers (Ray actors, one per engine node) start the servers
    fleet.generate_url            # the router when there is one, else None (talk to engines)
    fleet.engine_urls             # node rank 0 of every engine: weight updates, control calls
    fleet.recover()               # restart dead engines; they get the current weights (on_restart)
    fleet.close()

K engines of `tp` ranks over `nnodes` nodes each. Generation goes through sglang-router when
there is one (all n samples of a prompt travel in one request, so they land on one engine);
weight updates and control calls go to every engine directly, never through the router. A dead
engine is taken out of the router, restarted by its launchers, handed the current weights by the
`on_restart` callback (the trainer's weight sync), and only then put back: an engine never serves
with stale weights. Every restart is counted (`restarts`); past `max_restarts` the run fails.
Recovery may be asked for from several threads (the trainer's, a rollout thread running ahead):
it runs under one lock, so a dead engine is restarted once.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from megarl.rollout.client.client import RolloutClient
from megarl.rollout.fleet.engine_launcher import EngineLauncher, EngineNodeSpec

log = logging.getLogger(__name__)


class EngineFailure(RuntimeError):
    """An engine could not be (re)started, or failed more often than rollout.max_engine_restarts."""


@dataclass
class RouterSpec:
    policy: str = "round_robin"
    host: str = "127.0.0.1"
    log_path: str = "router.log"


@dataclass
class _Engine:
    index: int
    launchers: list
    url: str | None = None
    restarts: int = 0


class RolloutFleet:
    def __init__(
        self,
        engine_specs: list[list[EngineNodeSpec]],
        *,
        api_key: str | None = None,
        router: RouterSpec | None = None,
        placement: Callable[[int, int], dict] | None = None,
        gpu_ids: Callable[[int, int], list[str]] | None = None,
        request_timeout_s: float = 60.0,
        max_restarts: int = 3,
    ):
        """engine_specs[e][k]: node k of engine e. placement(e, k) -> Ray actor options that pin
        that node's launcher (scheduling strategy, resources); gpu_ids(e, k) -> its GPUs."""
        self.specs, self.api_key, self.router_spec = engine_specs, api_key, router
        self._placement = placement or (lambda e, k: {})
        self._gpu_ids = gpu_ids or (lambda e, k: [])
        self.request_timeout_s, self.max_restarts = request_timeout_s, max_restarts
        self.engines: list[_Engine] = []
        self.router = None  # a RouterActor handle
        self.router_url: str | None = None
        self.on_restart: Callable[[list[str]], None] | None = None
        self.restarts = 0
        self._id = uuid.uuid4().hex[:6]  # Ray actor names of this fleet
        self._pending: dict[int, list] = {}  # engine -> start refs of a restart in flight
        self._starting: dict[int, list] = {}  # engine -> start refs of the first start
        self._clients: dict[tuple, RolloutClient] = {}  # (url, options): kept_client
        self._recovery = threading.RLock()  # recover / finish_recovery, from any thread
        self._clients_lock = threading.Lock()  # kept_client from the loop, _detach from a recovery
        self.lora_path: str | None = None  # the LoRA adapter its clients' requests name

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> RolloutFleet:
        self.launch()
        self.wait_started()
        return self

    def launch(self) -> None:
        """Place the launchers and start every engine at once; wait_started() waits for them."""
        import ray

        launcher_cls = ray.remote(EngineLauncher)
        for e, nodes in enumerate(self.specs):
            launchers = [
                launcher_cls.options(
                    name=f"rollout_{self._id}_{spec.name}", num_cpus=0, **self._placement(e, spec.node_rank)
                ).remote(spec, self.api_key, self._gpu_ids(e, spec.node_rank))
                for spec in nodes
            ]
            self.engines.append(_Engine(e, launchers))
        self._starting = {e.index: self._start_refs(e) for e in self.engines}  # all start together

    def wait_started(self) -> None:
        for index, refs in sorted(self._starting.items()):
            self._finish_start(self.engines[index], refs)
        self._starting = {}
        self._check_reachable()
        if self.router_spec is not None:
            self._start_router()

    def _start_refs(self, engine: _Engine) -> list:
        import ray

        addr = ray.get(engine.launchers[0].dist_init_addr.remote()) if len(engine.launchers) > 1 else None
        return [launcher.start.remote(addr) for launcher in engine.launchers]

    def _finish_start(self, engine: _Engine, refs: list) -> None:
        import ray

        try:
            engine.url = ray.get(refs)[0]
        except ray.exceptions.RayError as exc:
            raise EngineFailure(f"rollout engine {engine.index} did not start: {_cause(exc)}") from exc

    def _check_reachable(self) -> None:
        """Engines bound to loopback can only be reached from their own node: say so at start
        rather than failing every request on a multi-node cluster."""
        import ray

        from megarl.procs.net import is_loopback

        loopback = [e for e in self.engines if is_loopback(self.specs[e.index][0].host)]
        if not loopback:
            return
        here = ray.util.get_node_ip_address()  # raylets sharing one machine share its loopback
        for engine in loopback:
            if ray.get(engine.launchers[0].node_ip.remote()) != here:
                raise EngineFailure(
                    f"rollout engine {engine.index} runs on another machine than the controller but binds "
                    f"rollout.host={self.specs[engine.index][0].host}; set rollout.host=0.0.0.0 so engines "
                    "bind every interface and are reached at their node's IP (they get the run's API key)"
                )

    def _start_router(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from megarl.rollout.fleet.router_actor import RouterActor

        spec = self.router_spec
        # on the driver's node: a router bound to loopback must be where its client is
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self.router = (
            ray.remote(RouterActor)
            .options(name=f"rollout_{self._id}_router", num_cpus=0, scheduling_strategy=here)
            .remote(self.engine_urls, spec.policy, spec.host, spec.log_path, self.api_key)
        )
        self.router_url = ray.get(self.router.start.remote())

    def close(self) -> None:
        import ray

        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
        if not ray.is_initialized():
            return
        handles = ([self.router] if self.router is not None else []) + [
            launcher for e in self.engines for launcher in e.launchers
        ]
        stops = [h.stop.remote() for h in handles]
        try:
            ray.get(stops, timeout=60)
        except ray.exceptions.RayError as exc:  # a dead launcher took its server's group with it
            log.warning("stopping the rollout fleet: %s", _cause(exc))
        for handle in handles:
            ray.kill(handle, no_restart=True)
        self.engines, self.router = [], None

    # ---- addresses ------------------------------------------------------------------------------
    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines if e.url is not None]

    def _control_client(self, url: str) -> RolloutClient:
        """One kept client per engine for control calls."""
        return self.kept_client(url, max_retries=1)

    def kept_client(self, url: str, **kwargs) -> RolloutClient:
        """A client for `url` made once per set of options and kept until close(): a client owns a
        thread, an event loop and a connection pool, ~ms of CPU to make and close, which a call
        made every step (the asynchronous loops' parity probe) should not pay each time."""
        key = (url, tuple(sorted(kwargs.items())))
        with self._clients_lock:
            if key not in self._clients:
                self._clients[key] = self.client(url, **kwargs)
            return self._clients[key]

    def client(self, url: str, **kwargs) -> RolloutClient:
        client = RolloutClient(
            url, api_key=self.api_key, timeout_s=kwargs.pop("timeout_s", self.request_timeout_s), **kwargs
        )
        client.lora_path = self.lora_path
        return client

    def use_lora_adapter(self, name: str | None) -> None:
        """Requests through this fleet's clients name LoRA adapter `name` (RolloutManager's)."""
        self.lora_path = name
        with self._clients_lock:
            for client in self._clients.values():
                client.lora_path = name

    def abort_all_requests(self) -> None:
        """Best effort: every engine aborts what it queues and runs, so its callers get answers at
        once (an engine that cannot be reached has nothing running)."""
        for url in self.engine_urls:
            try:
                with self.client(url, timeout_s=10.0, max_retries=0) as client:
                    client.abort_request(abort_all=True)
            except Exception:  # noqa: BLE001
                pass

    # ---- health and recovery --------------------------------------------------------------------
    def dead_engines(self) -> list[int]:
        """Engines with a node whose server process is gone or whose rank 0 fails /health."""
        import ray

        dead = []
        for engine in self.engines:
            if engine.index in self._pending or engine.url is None:
                continue
            try:
                alive = all(ray.get([launcher.alive.remote() for launcher in engine.launchers], timeout=30))
            except ray.exceptions.RayError:
                alive = False
            if alive:
                with self.client(engine.url, max_retries=0) as client:
                    alive = client.health()
            if not alive:
                dead.append(engine.index)
        return dead

    def recover(self, wait: bool = False) -> list[int]:
        """Take dead engines out of service and restart them. With a live engine left the restart
        runs in the background (finish_recovery waits for it); with none, it is waited for here.
        Returns the engines found dead."""
        with self._recovery:
            return self._recover(wait)

    def _recover(self, wait: bool) -> list[int]:
        dead = self.dead_engines()
        for index in dead:
            engine = self.engines[index]
            engine.restarts += 1
            self.restarts += 1
            if engine.restarts > self.max_restarts:
                raise EngineFailure(
                    f"rollout engine {index} died {engine.restarts} times; "
                    f"rollout.max_engine_restarts={self.max_restarts}. Its log says why: "
                    f"{self.specs[index][0].log_path}"
                )
            log.warning(
                "rollout engine %d (%s) is dead; restarting it (restart %d)", index, engine.url, engine.restarts
            )
            self._detach(engine)
            self._pending[index] = self._start_refs(engine)  # EngineLauncher.start stops leftovers first
        if wait or not self.live_urls():
            self.finish_recovery()
        return dead

    def finish_recovery(self, only_ready: bool = False) -> list[str]:
        """Wait for restarts in flight, give the engines the current weights, then route to them.
        `only_ready`: only the restarts already up (nothing waited for); the rest stay pending."""
        import ray

        with self._recovery:
            if only_ready:
                ready = {
                    i: refs
                    for i, refs in self._pending.items()
                    if not ray.wait(refs, num_returns=len(refs), timeout=0)[1]
                }
            else:
                ready = dict(self._pending)
            return self._finish_recovery(ready) if ready else []

    def _finish_recovery(self, pending: dict[int, list]) -> list[str]:
        started = time.perf_counter()
        restarted = []
        for index, refs in sorted(pending.items()):
            engine = self.engines[index]
            while True:  # a restart that fails to start is tried again, within the same budget
                try:
                    self._finish_start(engine, refs)
                    break
                except EngineFailure:
                    if engine.restarts >= self.max_restarts:
                        raise
                    engine.restarts += 1
                    self.restarts += 1
                    refs = self._pending[index] = self._start_refs(engine)
            restarted.append(engine)
        urls = [e.url for e in restarted]
        if self.on_restart is not None:
            # still pending meanwhile: not in live_urls (direct routes) nor in the router. Should
            # this fail, they stay so, and the next finish_recovery gives them the weights again
            self.on_restart(urls)
        for engine in restarted:
            del self._pending[engine.index]
        for engine in restarted:
            self._attach(engine)
        log.warning("restarted rollout engines %s in %.1fs", urls, time.perf_counter() - started)
        return urls

    def live_urls(self) -> list[str]:
        return [e.url for e in self.engines if e.url is not None and e.index not in self._pending]

    def _detach(self, engine: _Engine) -> None:
        import ray

        if self.router is not None and engine.url is not None:
            ray.get(self.router.remove_worker.remote(engine.url))
        with self._clients_lock:
            gone = [self._clients.pop(k) for k in [k for k in self._clients if k[0] == engine.url]]
        for client in gone:
            client.close()
        engine.url = None

    def _attach(self, engine: _Engine) -> None:
        import ray

        if self.router is not None:
            ray.get(self.router.add_worker.remote(engine.url))

    # ---- control calls on every engine ----------------------------------------------------------
    def for_each_engine(self, call: Callable[[RolloutClient], object]) -> list:
        """Run a control call on every live engine directly; a dead engine is restarted (and
        resynced) first rather than failing the run."""
        results = []
        for engine in list(self.engines):
            for attempt in range(2):
                if engine.url is None:
                    break
                try:
                    results.append(call(self._control_client(engine.url)))
                    break
                except Exception:  # noqa: BLE001 (any failure: find out whether the engine died)
                    if attempt or engine.index not in self.recover(wait=True):
                        raise
        return results

    def release_memory(self, tags: list[str]) -> None:
        self.for_each_engine(lambda c: c.release_memory_occupation(tags))

    def resume_memory(self, tags: list[str]) -> None:
        self.for_each_engine(lambda c: c.resume_memory_occupation(tags))

    def server_pids(self) -> list[list[int | None]]:
        """Each engine's server pids per node (what a failure test kills)."""
        import ray

        return [ray.get([launcher.server_pid.remote() for launcher in e.launchers]) for e in self.engines]


def _cause(exc: BaseException) -> str:
    return str(getattr(exc, "cause", None) or exc).strip().splitlines()[-1][:2000]
