"""RayWorkerGroup and RayCluster on a real local Ray cluster (2 CPUs, 2-rank groups).

One cluster serves the whole module because Ray takes seconds to start on two cores; the last test
SIGTERMs the controller (this process) during a call, closes the cluster and checks that no Ray
process survives.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
import ray.cloudpickle
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from megarl.controller import (
    Dispatch,
    MeshCoord,
    PendingCall,
    RayCluster,
    RayWorkerGroup,
    Worker,
    WorkerError,
    register,
)
from megarl.controller.cluster import _is_ray_process
from megarl.data.batch import Batch

torch.set_num_threads(1)
# Workers cannot import this test module (pytest put tests/ on sys.path only here), so ship the
# worker classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ToyWorker(Worker):
    def __init__(self, offset: int = 0, **dist_args):
        super().__init__(**dist_args)
        self.offset = offset
        self.rows_seen: list[float] = []

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def rank_plus_offset(self) -> int:
        return self.rank + self.offset

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def all_reduce_sum(self, value: float) -> float:
        tensor = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(tensor)
        return tensor.item()

    @register(dispatch=Dispatch.ALL_TO_ALL)
    def scale(self, x: int) -> int:
        return x * (self.rank + 1)

    @register(dispatch=Dispatch.RANK_ZERO)
    def rank_and_world(self) -> tuple[int, int]:
        dist.barrier()  # every rank must take part, which is why RANK_ZERO calls them all
        return self.rank, dist.get_world_size()

    @register(dispatch=Dispatch.DP_COMPUTE)
    def double_and_tag(self, batch: Batch) -> Batch:
        self.rows_seen = batch["x"].tolist()
        out = Batch(tensors={"y": batch["x"] * 2, "computed_by": torch.full((len(batch),), self.rank)})
        return out

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def get_rows_seen(self) -> list[float]:
        return self.rows_seen

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def fail_on_rank(self, bad_rank: int) -> int:
        if self.rank == bad_rank:
            raise ValueError(f"deliberate failure on rank {self.rank}")
        return self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL, blocking=False)
    def rank_after(self, delay_s: float) -> int:
        time.sleep(delay_s)
        return self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def environment(self, key: str) -> tuple[str | None, int]:
        return os.environ.get(key), torch.get_num_threads()


class FakeTensorParallelWorker(ToyWorker):
    """Reports tp=world, dp=1, as a Megatron engine with tp=2 would."""

    def get_mesh_coord(self) -> MeshCoord:
        return MeshCoord(rank=self.rank, tp_rank=self.rank, tp_size=self.world_size)


HANDLERS_BEFORE_CLUSTER: dict[int, object] = {}


@pytest.fixture(scope="module")
def cluster():
    HANDLERS_BEFORE_CLUSTER.update({s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)})
    # started in the background, as `megarl train` starts its cluster: ray.init runs on a thread,
    # whose Ray processes (forked there under a parent-death signal) must outlive ray.init; the
    # signal handlers are installed in this thread when `with` waits for the start
    ray_cluster = RayCluster(num_cpus=2, log_to_driver=False)
    ray_cluster.start(background=True)
    assert {s: signal.getsignal(s) for s in HANDLERS_BEFORE_CLUSTER} == HANDLERS_BEFORE_CLUSTER
    with ray_cluster:
        assert signal.getsignal(signal.SIGTERM) == ray_cluster._raise_to_unwind
        yield ray_cluster


@pytest.fixture(scope="module")
def dp_group(cluster):
    group = RayWorkerGroup(
        ToyWorker, 2, init_kwargs={"offset": 10}, num_cpus_per_worker=0.25, env_vars={"MEGARL_TEST_FLAG": "on"}
    )
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def shared_placement_group(cluster):
    """Made outside the group, as a colocating trainer would: the group must not remove it."""
    pg = placement_group([{"CPU": 0.25}] * 3, strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    return pg


@pytest.fixture(scope="module")
def tp_group(shared_placement_group):
    group = RayWorkerGroup(
        FakeTensorParallelWorker,
        2,
        num_cpus_per_worker=0.25,
        placement_group=shared_placement_group,
        bundle_offset=1,
        name_prefix="faketp",
    )
    yield group
    group.shutdown()


def test_one_to_all_reaches_every_rank_with_init_kwargs(dp_group):
    assert dp_group.rank_plus_offset() == [10, 11]
    assert dp_group.mesh == [MeshCoord(rank=0, dp_rank=0, dp_size=2), MeshCoord(rank=1, dp_rank=1, dp_size=2)]


def test_gloo_all_reduce_across_ranks_returns_the_sum_on_every_rank(dp_group):
    assert dp_group.all_reduce_sum(1.5) == [1.5 * 1 + 1.5 * 2] * 2


def test_all_to_all_and_rank_zero(dp_group):
    assert dp_group.scale([5, 7]) == [5, 14]
    assert dp_group.rank_and_world() == (0, 2)


def test_dp_compute_splits_by_dp_rank_and_concatenates(dp_group):
    batch = Batch(tensors={"x": torch.arange(6, dtype=torch.float32)})
    out = dp_group.double_and_tag(batch)
    assert out["y"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert out["computed_by"].tolist() == [0, 0, 0, 1, 1, 1]
    assert dp_group.get_rows_seen() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_dp_compute_with_tensor_parallel_peers_gives_both_the_whole_batch(tp_group):
    assert [c.tp_rank for c in tp_group.mesh] == [0, 1] and tp_group.mesh[0].dp_size == 1
    batch = Batch(tensors={"x": torch.arange(4, dtype=torch.float32)})
    out = tp_group.double_and_tag(batch)
    assert out["y"].tolist() == [0.0, 2.0, 4.0, 6.0]
    assert out["computed_by"].tolist() == [0, 0, 0, 0]  # only tp rank 0's output is kept
    assert tp_group.get_rows_seen() == [[0.0, 1.0, 2.0, 3.0]] * 2


def test_worker_exception_names_the_rank_and_keeps_the_cause(dp_group):
    with pytest.raises(WorkerError, match=r"rank 1 of 2 .* raised in fail_on_rank\(\)") as info:
        dp_group.fail_on_rank(1)
    assert info.value.rank == 1
    assert isinstance(info.value.cause, ValueError)
    assert "deliberate failure on rank 1" in str(info.value)
    pid, node = dp_group.processes[1]["pid"], dp_group.processes[1]["node"]
    assert info.value.summary == (
        f"{dp_group.name} rank 1 (pid {pid}, node {node}) raised in fail_on_rank(): "
        "ValueError: deliberate failure on rank 1"
    )
    assert dp_group.fail_on_rank(5) == [0, 1]  # a failed call leaves the group usable


def test_non_blocking_method_returns_a_pending_call(dp_group):
    pending = dp_group.rank_after(0.2)
    assert isinstance(pending, PendingCall)
    assert pending.get(timeout_s=60) == [0, 1]


def test_env_vars_and_thread_count_reach_the_workers(dp_group):
    assert dp_group.environment("MEGARL_TEST_FLAG") == [("on", 1), ("on", 1)]
    # each rank's process is findable from outside: its pid is recorded and its env names it
    assert dp_group.environment("MEGARL_WORKER") == [(f"{dp_group.name}/0", 1), (f"{dp_group.name}/1", 1)]
    pids = [p["pid"] for p in dp_group.processes]
    assert [psutil.Process(pid).environ()["MEGARL_WORKER"] for pid in pids] == [f"{dp_group.name}/{r}" for r in (0, 1)]


def test_unschedulable_group_fails_with_the_cluster_resources(cluster):
    with pytest.raises(TimeoutError, match=r"could not reserve 2 bundles of \{'CPU': 64\}.*Lower num_cpus_per_worker"):
        RayWorkerGroup(ToyWorker, 2, num_cpus_per_worker=64, placement_timeout_s=1)


def test_failing_constructor_names_the_rank_and_releases_the_resources(cluster, dp_group):
    free_before = ray.available_resources().get("CPU", 0.0)
    expected = r"rank 0 of 2 died during __init__\(\)(.|\n)*unexpected keyword argument 'bogus'"
    with pytest.raises(WorkerError, match=expected):
        RayWorkerGroup(ToyWorker, 2, init_kwargs={"bogus": 1}, num_cpus_per_worker=0.25)
    _wait_for_free_cpus(free_before)


def test_bundle_range_outside_the_given_placement_group_is_rejected(shared_placement_group):
    with pytest.raises(ValueError, match=r"ranks need bundles \[2, 4\) but the given placement group has 3 bundles"):
        RayWorkerGroup(ToyWorker, 2, placement_group=shared_placement_group, bundle_offset=2)


def test_shutdown_kills_the_actors_but_keeps_a_placement_group_it_did_not_create(tp_group, shared_placement_group):
    actors = list(tp_group.actors)
    tp_group.shutdown()
    with pytest.raises(RuntimeError, match="was shut down"):
        tp_group.rank_plus_offset()
    _wait_until_dead(actors[0])
    assert placement_group_table(shared_placement_group)["state"] == "CREATED"
    free_before = ray.available_resources().get("CPU", 0.0)
    remove_placement_group(shared_placement_group)
    _wait_for_free_cpus(free_before + 3 * 0.25)


def test_a_rank_that_dies_while_nobody_calls_it_is_found_by_the_rank_watch(cluster):
    """Generation calls no rank: RankWatch's liveness checks find a death then, abort the wait
    (on_death) and raise the rank's WorkerError when the block ends."""
    import threading

    from megarl.trainer.rank_watch import RankWatch

    group = RayWorkerGroup(ToyWorker, 2, num_cpus_per_worker=0.25, name_prefix="watched")
    try:
        group.check_alive()  # both alive: no error
        aborted = threading.Event()
        with pytest.raises(WorkerError) as caught:
            with RankWatch([group, None], on_death=aborted.set, every_s=0.2):
                os.kill(group.processes[1]["pid"], signal.SIGKILL)
                assert aborted.wait(60), "the watch never noticed the dead rank"
        assert caught.value.rank == 1
        assert caught.value.summary.startswith(f"watched rank 1 (pid {group.processes[1]['pid']}, node ")
        assert "died during check_alive()" in caught.value.summary
    finally:
        group.shutdown()


def test_sigterm_during_a_call_unwinds_and_the_cluster_leaves_no_ray_process(cluster, dp_group):
    """Runs last: it closes the module's cluster, the way a SIGTERM'd controller would."""
    ray_processes = [p for p in psutil.Process().children(recursive=True) if _is_ray_process(p)]
    names = {p.name() for p in ray_processes}
    assert {"raylet", "gcs_server"} <= names and sum(n.startswith("ray::") for n in names) >= 1, names
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(SystemExit) as interrupted:
        dp_group.rank_after(60).get()  # the signal arrives while the controller blocks in Ray
    with pytest.raises(SystemExit) as exited:
        cluster.__exit__(interrupted.type, interrupted.value, interrupted.tb)
    assert exited.value.code == 128 + signal.SIGTERM
    assert _still_running(ray_processes) == []
    assert {s: signal.getsignal(s) for s in HANDLERS_BEFORE_CLUSTER} == HANDLERS_BEFORE_CLUSTER


def _still_running(processes: list[psutil.Process]) -> list[str]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {process.name()}")
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    """ray.kill is asynchronous: a call sent right after it may still reach the live actor and succeed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.get_mesh_coord.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
    pytest.fail(f"actor {actor} still answers {timeout_s:.0f} s after RayWorkerGroup.shutdown() killed it")


def _wait_for_free_cpus(expected: float, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) < expected - 1e-6 and time.monotonic() < deadline:
        time.sleep(0.1)  # placement-group removal is asynchronous
    assert ray.available_resources().get("CPU", 0.0) == pytest.approx(expected)


BACKGROUND_START_THEN_CLOSE = """
import psutil, sys
from megarl.controller.cluster import RayCluster
cluster = RayCluster(num_cpus=1, log_to_driver=False)
cluster.start(background=True)
if sys.argv[1] == "wait":
    with cluster:
        pass
else:
    cluster.close()  # the run failed before it needed Ray: nobody waited for the start
print(" ".join(p.name() for p in psutil.Process().children(recursive=True)
               if p.status() != psutil.STATUS_ZOMBIE), flush=True)
"""


@pytest.mark.parametrize("how", ["close-unwaited", "wait"])
def test_a_background_start_closed_at_any_point_leaves_no_ray_process(how):
    """close() right after start(background=True) waits for ray.init and stops what it started;
    a waited start closes like a foreground one (the Ray-start thread released)."""
    out = subprocess.run(
        [sys.executable, "-c", BACKGROUND_START_THEN_CLOSE, how],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", out.stdout
