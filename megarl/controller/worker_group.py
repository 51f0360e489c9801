"""RayWorkerGroup: N Ray actors running one Worker class as SPMD ranks.

Ray is only the transport here; how arguments are split and results gathered lives in dispatch.py.
Every method of the worker class decorated with @register becomes a method of the group:

    group = RayWorkerGroup(Actor, num_workers=4, init_args=(config,), num_cpus_per_worker=0.5)
    log_probs = group.compute_log_prob(batch)     # split by dp rank, gathered from the dp owners
    group.shutdown()
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.placement_group import placement_group as create_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import megarl
from megarl.controller.decorator import Registration, registration_of
from megarl.controller.dispatch import Dispatch, MeshCoord, collect_outputs, split_args, validate_mesh
from megarl.controller.shm_leftovers import remove_torch_shm_files
from megarl.controller.worker import Worker, get_node_ip
from megarl.data.batch import Batch

REPO_ROOT = str(Path(megarl.__file__).resolve().parents[1])


def pythonpath_with_repo(extra: str | None = None) -> str:
    """PYTHONPATH for Ray workers: the repo (workers must import megarl even where it is not
    pip-installed), then `extra`, then whatever the node already had (Ray expands ${PYTHONPATH})."""
    return ":".join(p for p in (REPO_ROOT, extra, "${PYTHONPATH}") if p)


WORKER_ENV = "MEGARL_WORKER"  # "<group name>/<rank>" in each rank's environment: find its process


class WorkerError(RuntimeError):
    """A worker raised (or died) during a group call; `rank` says which one. `summary` is one line
    for a user ("actor rank 1 (pid 4242, node 10.0.0.3) died during update_actor(): ..."); the
    message has the details (Ray's report, the remote traceback)."""

    def __init__(
        self, message: str, *, rank: int, method: str, cause: BaseException | None, summary: str | None = None
    ):
        super().__init__(message)
        self.rank = rank
        self.method = method
        self.cause = cause
        self.summary = summary or message.strip().splitlines()[0]


class RayWorkerGroup:
    def __init__(
        self,
        worker_cls: type[Worker],
        num_workers: int,
        *,
        init_args: Sequence[Any] = (),
        init_kwargs: dict[str, Any] | None = None,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0,
        placement_group: PlacementGroup | None = None,
        bundle_offset: int = 0,
        bundles: Sequence[tuple[PlacementGroup, int]] | None = None,
        resources_per_worker: dict[str, float] | None = None,
        env_vars: dict[str, str] | None = None,
        name_prefix: str | None = None,
        placement_timeout_s: float = 60.0,
        init_timeout_s: float = 600.0,
    ) -> None:
        """Start `num_workers` actors of `worker_cls`, one per placement-group bundle, and set up
        their torch.distributed world.

        placement_group None: the group creates its own (one bundle per rank, PACK) and removes it
        on shutdown. Given: ranks use bundles [bundle_offset, bundle_offset + num_workers), which
        lets several groups share (colocate on) the same bundles with fractional resources.
        bundles: an explicit (placement group, bundle index) per rank (a multi-node resource pool);
        resources_per_worker: custom Ray resources each rank takes from its bundle (devices).
        """
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"worker_cls must be a subclass of megarl.controller.Worker, got {worker_cls!r}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.worker_cls = worker_cls
        self.world_size = num_workers
        self.name = name_prefix or f"{worker_cls.__name__}_{uuid.uuid4().hex[:6]}"
        self.actors: list[ray.actor.ActorHandle] = []
        self.mesh: list[MeshCoord] = []
        self.processes: list[dict] = []  # per rank: {"pid": ..., "node": ...} (Worker.process_info)
        # calls from several threads reach every rank in one order (collectives match up)
        self._submitting = threading.Lock()
        if bundles is not None and len(bundles) != num_workers:
            raise ValueError(f"{self.name}: {len(bundles)} bundles given for {num_workers} ranks")
        self._bundles = list(bundles) if bundles is not None else None
        self._resources = dict(resources_per_worker or {})
        self._owns_placement_group = placement_group is None and bundles is None
        self._alive = True
        self.placement_group = placement_group
        registered = _registered_methods(worker_cls)
        if placement_group is not None and not 0 <= bundle_offset <= placement_group.bundle_count - num_workers:
            raise ValueError(
                f"{self.name}: ranks need bundles [{bundle_offset}, {bundle_offset + num_workers}) but the given "
                f"placement group has {placement_group.bundle_count} bundles"
            )
        try:
            if placement_group is None and bundles is None:
                self._create_placement_group(num_cpus_per_worker, num_gpus_per_worker, placement_timeout_s)
            self._start_actors(
                init_args, init_kwargs or {}, num_cpus_per_worker, num_gpus_per_worker, bundle_offset, env_vars or {}
            )
            self._init_distributed(init_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        for method_name, registration in registered.items():
            setattr(self, method_name, self._group_method(method_name, registration, getattr(worker_cls, method_name)))

    # ---- start-up -------------------------------------------------------------------------------

    def _create_placement_group(self, num_cpus: float, num_gpus: float, timeout_s: float) -> None:
        if num_cpus <= 0 and num_gpus <= 0:
            raise ValueError(f"{self.name}: each rank needs num_cpus_per_worker > 0 or num_gpus_per_worker > 0")
        bundle = {name: amount for name, amount in (("CPU", num_cpus), ("GPU", num_gpus)) if amount > 0}
        bundles = [dict(bundle) for _ in range(self.world_size)]
        pg = create_placement_group(bundles, strategy="PACK", name=f"{self.name}_pg")
        self.placement_group = pg
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"{self.name}: could not reserve {self.world_size} bundles of {bundle} within {timeout_s:.0f}s; "
                f"cluster has {ray.cluster_resources()} in total, {ray.available_resources()} free. "
                f"Lower num_cpus_per_worker/num_gpus_per_worker or add nodes."
            ) from None

    def _start_actors(
        self,
        init_args: Sequence[Any],
        init_kwargs: dict[str, Any],
        num_cpus: float,
        num_gpus: float,
        bundle_offset: int,
        env_vars: dict[str, str],
    ) -> None:
        env = dict(env_vars)
        env["PYTHONPATH"] = pythonpath_with_repo(env_vars.get("PYTHONPATH"))
        actor_cls = ray.remote(self.worker_cls)

        def start(rank: int, master_addr: str | None, master_port: int | None) -> ray.actor.ActorHandle:
            pg, bundle = self._bundles[rank] if self._bundles else (self.placement_group, bundle_offset + rank)
            return actor_cls.options(
                name=f"{self.name}_rank{rank}",
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                resources=self._resources or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle
                ),
                runtime_env={"env_vars": {**env, WORKER_ENV: f"{self.name}/{rank}"}},
            ).remote(
                *init_args,
                rank=rank,
                world_size=self.world_size,
                master_addr=master_addr,
                master_port=master_port,
                **init_kwargs,
            )

        # Rank 0 picks the rendezvous address on its own node; the rest are told it.
        self.actors.append(start(0, None, None))
        master_addr, master_port = self._gather([self.actors[0].get_master_addr_port.remote()], "__init__")[0]
        self.actors.extend(start(rank, master_addr, master_port) for rank in range(1, self.world_size))
        self.processes = self._gather([a.process_info.remote() for a in self.actors], "process_info")

    def _init_distributed(self, timeout_s: float) -> None:
        # All ranks must enter the rendezvous together, so submit to all before waiting on any.
        self._gather([a.init_distributed.remote() for a in self.actors], "init_distributed", timeout_s=timeout_s)
        self.mesh = self._gather([a.get_mesh_coord.remote() for a in self.actors], "get_mesh_coord")
        validate_mesh(self.mesh)

    # ---- calls ----------------------------------------------------------------------------------

    def _group_method(self, method_name: str, registration: Registration, worker_method: Any):
        def call(*args: Any, **kwargs: Any) -> Any:
            pending = self.submit(method_name, registration.dispatch, *args, **kwargs)
            return pending.get() if registration.blocking else pending

        functools.update_wrapper(call, worker_method)
        return call

    def submit(self, method_name: str, dispatch: Dispatch, *args: Any, **kwargs: Any) -> PendingCall:
        """Start `method_name` on every rank with arguments split per `dispatch`; don't wait."""
        if not self._alive:
            raise RuntimeError(f"{self.name}: the worker group was shut down; create a new one")
        calls = _share_repeated_args(split_args(dispatch, self.mesh, args, kwargs))
        with self._submitting:
            refs = [getattr(actor, method_name).remote(*a, **k) for actor, (a, k) in zip(self.actors, calls)]
        return PendingCall(self, method_name, dispatch, refs)

    def check_alive(self, timeout_s: float = 30.0) -> None:
        """Raise WorkerError naming the first rank whose process died. Each rank answers Ray's
        built-in no-op (`__ray_ready__`) at once when idle; a rank busy or slow past `timeout_s`
        counts as alive (this looks for deaths, not hangs)."""
        try:
            self._gather([a.__ray_ready__.remote() for a in self.actors], "check_alive", timeout_s=timeout_s)
        except TimeoutError:
            pass

    def _gather(self, refs: list[ray.ObjectRef], method_name: str, timeout_s: float | None = None) -> list[Any]:
        """Results in rank order; the first worker failure is raised at once, naming its rank."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        while rank_of:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(rank_of), num_returns=1, timeout=remaining)
            if not ready:
                waiting = sorted(rank_of.values())
                raise TimeoutError(f"{self.name}.{method_name}: ranks {waiting} did not finish within {timeout_s:.0f}s")
            rest = [r for r in rank_of if r not in ready]
            others, _ = ray.wait(rest, num_returns=len(rest), timeout=0) if rest else ([], [])
            for ref in ready + others:
                rank = rank_of.pop(ref)
                try:
                    results[rank] = self._get_one(ref, rank, method_name)
                except WorkerError:
                    _collect_quietly(list(rank_of))
                    raise
        return results

    def _get_one(self, ref: ray.ObjectRef, rank: int, method_name: str) -> Any:
        who = f"{self.name} rank {rank}"
        if rank < len(self.processes):
            who += f" (pid {self.processes[rank]['pid']}, node {self.processes[rank]['node']})"
        where = f"{self.name} rank {rank} of {self.world_size}"
        if rank < len(self.mesh):
            where += f" [{self.mesh[rank].describe()}]"
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as error:
            cause = getattr(error, "cause", None)
            message = f"{where} raised in {method_name}():\n{error}"
            summary = f"{who} raised in {method_name}(): {_one_line(cause or error)}"
            raise WorkerError(message, rank=rank, method=method_name, cause=cause, summary=summary) from error
        except ray.exceptions.RayActorError as error:
            raise WorkerError(
                f"{where} died during {method_name}() (crash, OOM kill or failed constructor):\n{error}",
                rank=rank,
                method=method_name,
                cause=error,
                summary=f"{who} died during {method_name}(): {_death_cause(error)}",
            ) from error
        except ray.exceptions.RayError as error:  # lost objects, cancellation, ...
            message = f"{where}: Ray could not return the result of {method_name}():\n{error}"
            summary = f"{who}: Ray could not return the result of {method_name}(): {_one_line(error)}"
            raise WorkerError(message, rank=rank, method=method_name, cause=error, summary=summary) from error

    # ---- teardown -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Kill every actor and remove the placement group this group created. Idempotent."""
        if not self._alive:
            return
        self._alive = False
        if not ray.is_initialized():
            return  # the cluster is gone, and with it every actor and placement group
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        here = get_node_ip()  # the ranks on this host: their torch shared-memory files go too
        remove_torch_shm_files([p["pid"] for p in self.processes if p.get("node") == here])
        if self._owns_placement_group and self.placement_group is not None:
            remove_placement_group(self.placement_group)

    def __enter__(self) -> RayWorkerGroup:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()


class PendingCall:
    """A submitted group call; `get()` waits for every rank and gathers per the dispatch mode."""

    def __init__(self, group: RayWorkerGroup, method_name: str, dispatch: Dispatch, refs: list[ray.ObjectRef]):
        self.group = group
        self.method_name = method_name
        self.dispatch = dispatch
        self.refs = refs

    def get(self, timeout_s: float | None = None) -> Any:
        outputs = self.group._gather(self.refs, self.method_name, timeout_s=timeout_s)
        return collect_outputs(self.dispatch, self.group.mesh, outputs)


def _collect_quietly(refs: list[ray.ObjectRef], within_s: float = 2.0) -> None:
    """The other ranks' results of a call that failed on one: fetched (errors too) when they end
    within `within_s`, so Ray does not print their errors later as "Unhandled error" lines about a
    failure already raised."""
    if not refs:
        return
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=within_s)
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayError:
            pass


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _death_cause(error: BaseException) -> str:
    """Ray's long report of a dead actor, cut to what happened (a SIGKILL reads "Worker
    unexpectedly exits with a connection error code 2. End of file")."""
    detail = re.search(r"Worker exit detail: (.+?)(?:\. Some common causes|$)", str(error), re.S)
    if detail:
        return (
            f"its process ended unexpectedly (killed, e.g. by the OOM killer, or crashed); "
            f"Ray: {' '.join(detail.group(1).split())}"
        )
    return _one_line(error)


def _registered_methods(worker_cls: type[Worker]) -> dict[str, Registration]:
    methods = {}
    for method_name, member in inspect.getmembers(worker_cls):
        registration = registration_of(member)
        if registration is None:
            continue
        if hasattr(RayWorkerGroup, method_name):
            raise ValueError(
                f"{worker_cls.__name__}.{method_name} is registered but clashes with "
                f"RayWorkerGroup.{method_name}; rename it"
            )
        methods[method_name] = registration
    return methods


def _share_repeated_args(calls: list[tuple[tuple, dict]]) -> list[tuple[tuple, dict]]:
    """Put a large argument that goes to several workers into the object store once, instead of
    serializing it once per worker (tp/pp peers of one dp rank all receive the same chunk)."""
    uses: dict[int, int] = {}
    for args, kwargs in calls:
        for value in (*args, *kwargs.values()):
            if isinstance(value, (Batch, torch.Tensor, np.ndarray)):
                uses[id(value)] = uses.get(id(value), 0) + 1
    refs: dict[int, ray.ObjectRef] = {}

    def shared(value: Any) -> Any:
        if uses.get(id(value), 0) < 2:
            return value
        if id(value) not in refs:
            refs[id(value)] = ray.put(value)
        return refs[id(value)]

    return [(tuple(shared(a) for a in args), {k: shared(v) for k, v in kwargs.items()}) for args, kwargs in calls]
