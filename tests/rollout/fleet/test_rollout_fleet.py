"""The rollout side as a mesh on a real local Ray cluster: engines started by launcher actors in
a resource pool, sglang-router in front, generation with n samples of a prompt on one engine,
and failover (SIGKILL an engine mid-generation: every row still comes back, the engine is
restarted, gets the current weights before it rejoins the router, every retry is counted). An
answer with another weight version than the one asked for is never used; a restarted engine whose
resync failed is served by no one until a resync succeeds; a restart never reuses a port."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import httpx
import psutil
import pytest
import torch

from megarl.data.batch import Batch
from megarl.rollout.client.manager import RolloutManager, SamplingSpec
from megarl.rollout.fleet.engine_launcher import EngineNodeSpec
from megarl.rollout.fleet.fleet import RolloutFleet, RouterSpec
from tests._failures import run_while_killing

torch.set_num_threads(1)
PROMPTS = [[2, 10 + i, 11 + i, 3] for i in range(8)]
KEY = "per-run-key-for-the-test"
MANY_PROMPTS = [[2, 10 + i % 30, 11 + i // 30, 3] for i in range(32)]  # distinct: spread by the router


@pytest.fixture(scope="module")
def ray_pool():
    from megarl.controller.cluster import RayCluster
    from megarl.controller.placement import CPU_DEVICE_RESOURCE, PoolSpec, ResourcePool

    with RayCluster(num_cpus=2, resources={CPU_DEVICE_RESOURCE: 2.0}, log_to_driver=False):
        pool = ResourcePool(PoolSpec("rollout", 2, 2), CPU_DEVICE_RESOURCE)
        yield pool
        pool.remove()


def make_fleet(pool, model_path, log_dir, num_engines: int, router: bool, api_key: str | None = None) -> RolloutFleet:
    from megarl.controller.placement import LAUNCHER_DEVICE_SHARE, scheduling

    specs = [
        [
            EngineNodeSpec(
                backend="embedded",
                model_path=str(model_path),
                engine=e,
                seed=e,
                max_batch_size=64,
                log_path=str(log_dir / f"engine{e}.log"),
            )
        ]
        for e in range(num_engines)
    ]

    def placement(e, k):
        return {
            "scheduling_strategy": scheduling(pool, pool.spec.slot(e)),
            "resources": {pool.resource: LAUNCHER_DEVICE_SHARE},
        }

    return RolloutFleet(
        specs,
        router=RouterSpec(policy="cache_aware", log_path=str(log_dir / "router.log")) if router else None,
        placement=placement,
        max_restarts=2,
        request_timeout_s=60,
        api_key=api_key,
    )


def _wait_dead(pid: int, timeout_s: float = 30) -> None:
    """Until `pid` is gone or a zombie (its parent, the launcher actor, reaps it when asked)."""
    deadline = threading.Event()
    for _ in range(int(timeout_s / 0.05)):
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        deadline.wait(0.05)
    raise AssertionError(f"process {pid} still running {timeout_s}s after SIGKILL")


def prompt_batch(prompts) -> Batch:
    return Batch(non_tensors={"raw_prompt_ids": [list(p) for p in prompts], "uid": list(range(len(prompts)))})


AUTH = {"Authorization": f"Bearer {KEY}"}


def finished(url: str) -> int:
    return (
        httpx.get(f"{url}/get_server_info", headers=AUTH, timeout=10).json()["engine_stats"].get("requests_finished", 0)
    )


@pytest.fixture(scope="module")
def two_engines(ray_pool, tiny_model_path, tmp_path_factory):
    fleet = make_fleet(ray_pool, tiny_model_path, tmp_path_factory.mktemp("fleet2"), 2, router=True, api_key=KEY)
    with contextlib.ExitStack() as stack:
        stack.callback(fleet.close)
        fleet.start()
        manager = RolloutManager(fleet=fleet, max_retries=1, timeout_s=60, api_key=KEY)
        stack.callback(manager.close)
        yield fleet, manager


def test_launchers_place_engines_and_the_router_fronts_them(two_engines):
    fleet, _ = two_engines
    import ray

    for url in [*fleet.engine_urls, fleet.router_url]:  # the per-run key guards engines and router
        assert httpx.post(f"{url}/generate", json={"input_ids": [2, 3]}, timeout=10).status_code == 401
    assert len(fleet.engine_urls) == 2 and fleet.router_url not in fleet.engine_urls
    assert sorted(ray.get(fleet.router.workers.remote())) == sorted(fleet.engine_urls)
    for pids in fleet.server_pids():  # servers are children of the launcher actors, not of us
        assert psutil.Process(pids[0]).ppid() != os.getpid()


def test_n_samples_of_a_prompt_land_on_one_engine(two_engines):
    fleet, manager = two_engines
    before = [finished(u) for u in fleet.engine_urls]
    rows = manager.generate(prompt_batch(PROMPTS), SamplingSpec(n=4, max_new_tokens=3))
    served = [finished(u) - b for u, b in zip(fleet.engine_urls, before)]
    assert len(rows) == len(PROMPTS) * 4 and sum(served) == len(PROMPTS) * 4
    assert all(count % 4 == 0 for count in served), served  # whole groups of n per engine
    assert manager.last_stats == {"rollout/retries": 0.0, "rollout/engine_restarts": 0.0}


def generate_while_killing(fleet, manager, engine: int, prompts, sampling):
    return run_while_killing(fleet, engine, lambda: manager.generate(prompt_batch(prompts), sampling))


def test_sigkill_one_engine_mid_step_every_row_comes_back_and_it_rejoins_with_weights(two_engines):
    fleet, manager = two_engines
    import ray

    resynced = []

    def on_restart(urls):  # the trainer's weight sync; the engine must not be routed to yet
        routed = ray.get(fleet.router.workers.remote())
        resynced.append((list(urls), [u for u in urls if u in routed]))

    fleet.on_restart = on_restart
    try:
        rows, victim_pid = generate_while_killing(fleet, manager, 1, MANY_PROMPTS, SamplingSpec(n=4, max_new_tokens=64))
    finally:
        fleet.on_restart = None
    assert len(rows) == len(MANY_PROMPTS) * 4
    assert all(r != "abort" for r in rows["finish_reason"])
    assert manager.last_stats["rollout/engine_restarts"] == 1.0
    assert manager.last_stats["rollout/retries"] >= 1.0
    ((urls, routed_before_weights),) = resynced
    assert routed_before_weights == [] and urls == [fleet.engine_urls[1]]
    assert sorted(ray.get(fleet.router.workers.remote())) == sorted(fleet.engine_urls)
    assert not psutil.pid_exists(victim_pid) or psutil.Process(victim_pid).status() == psutil.STATUS_ZOMBIE
    again = manager.generate(prompt_batch(PROMPTS[:2]), SamplingSpec(n=2, max_new_tokens=2))
    assert len(again) == 4 and manager.last_stats["rollout/engine_restarts"] == 0.0


def test_single_engine_killed_mid_step_is_restarted_and_the_step_retried(ray_pool, tiny_model_path, tmp_path):
    fleet = make_fleet(ray_pool, tiny_model_path, tmp_path, 1, router=False)
    with contextlib.ExitStack() as stack:
        stack.callback(fleet.close)
        fleet.start()
        manager = RolloutManager(fleet=fleet, max_retries=1, timeout_s=60)
        stack.callback(manager.close)
        rows, _ = generate_while_killing(fleet, manager, 0, PROMPTS, SamplingSpec(n=4, max_new_tokens=64))
        assert len(rows) == len(PROMPTS) * 4
        assert manager.last_stats["rollout/engine_restarts"] == 1.0
        assert manager.last_stats["rollout/retries"] >= len(PROMPTS)  # the whole batch was re-sent
        assert fleet.engine_urls and httpx.get(f"{fleet.engine_urls[0]}/health", timeout=5).status_code == 200
        pids = [p for nodes in fleet.server_pids() for p in nodes]
    assert all(not psutil.pid_exists(p) for p in pids)  # close() left no server behind


def test_two_node_engine_is_started_by_one_launcher_per_node_and_restarted_whole(ray_pool, tiny_model_path, tmp_path):
    """tp=2 over 2 "nodes": two launcher actors rendezvous through node 0's dist-init address;
    killing node 1 takes the engine down, and the fleet restarts both nodes."""
    from megarl.controller.placement import LAUNCHER_DEVICE_SHARE, scheduling

    specs = [
        [
            EngineNodeSpec(
                backend="embedded",
                model_path=str(tiny_model_path),
                engine=0,
                node_rank=k,
                nnodes=2,
                tp=2,
                seed=0,
                log_path=str(tmp_path / f"node{k}.log"),
            )
            for k in range(2)
        ]
    ]
    fleet = RolloutFleet(
        specs,
        api_key=KEY,
        max_restarts=1,
        placement=lambda e, k: {
            "scheduling_strategy": scheduling(ray_pool, ray_pool.spec.slot(k)),
            "resources": {ray_pool.resource: LAUNCHER_DEVICE_SHARE},
        },
    )
    with contextlib.ExitStack() as stack:
        stack.callback(fleet.close)
        fleet.start()
        manager = RolloutManager(fleet=fleet, max_retries=0, timeout_s=60, api_key=KEY)
        stack.callback(manager.close)
        info = httpx.get(f"{fleet.engine_urls[0]}/get_server_info", headers=AUTH, timeout=10).json()
        assert (info["tp_size"], info["nnodes"]) == (2, 2)
        assert len(manager.generate(prompt_batch(PROMPTS[:2]), SamplingSpec(n=2, max_new_tokens=3))) == 4
        node0, node1 = fleet.server_pids()[0]
        os.kill(node1, signal.SIGKILL)
        _wait_dead(node1)  # a SIGKILL lands when the kernel next runs the process
        assert fleet.recover(wait=True) == [0] and fleet.restarts == 1
        assert len(manager.generate(prompt_batch(PROMPTS[:2]), SamplingSpec(n=2, max_new_tokens=3))) == 4
        pids = fleet.server_pids()[0]
        assert node0 not in pids and node1 not in pids
    assert (tmp_path / "node0.log").stat().st_size and (tmp_path / "node1.log").stat().st_size
    assert not any(psutil.pid_exists(p) for p in pids)


def label(url: str, version: str) -> None:
    """What a weight sync writes: the version the engine reports with every answer."""
    body = {"new_version": version, "abort_all_requests": False}
    assert httpx.post(f"{url}/update_weight_version", json=body, headers=AUTH, timeout=10).status_code == 200


def test_an_engine_on_another_weight_version_is_never_used_silently(two_engines):
    from megarl.rollout.client.client import RolloutRequestError

    fleet, manager = two_engines
    url0, url1 = fleet.engine_urls
    try:
        label(url0, "7")
        label(url1, "7")
        rows = manager.generate(prompt_batch(PROMPTS), SamplingSpec(n=2, max_new_tokens=2), weight_version="7")
        assert list(rows["rollout_weight_version"]) == ["7"] * len(PROMPTS) * 2
        assert manager.last_stats["rollout/retries"] == 0.0
        # engine 1 missed the last sync: its prompts are re-sent once, then the call fails saying so
        # (direct routes here, so which prompts land on engine 1 is fixed: half of them)
        label(url1, "6")
        direct = RolloutManager([url0, url1], max_retries=0, timeout_s=60, api_key=KEY)
        try:
            with pytest.raises(
                RolloutRequestError, match="served with weight_version '6', but the engines were synced to '7'"
            ):
                direct.generate(prompt_batch(PROMPTS), SamplingSpec(n=2, max_new_tokens=2), weight_version="7")
        finally:
            direct.close()
        # behind the router: a row from engine 1 is never returned (the call fails, or holds only "7")
        try:
            rows = manager.generate(prompt_batch(MANY_PROMPTS), SamplingSpec(n=2, max_new_tokens=2), weight_version="7")
            assert set(rows["rollout_weight_version"]) == {"7"}
        except RolloutRequestError as exc:
            assert "weight_version '6'" in str(exc)
    finally:
        label(url0, "default")
        label(url1, "default")


def test_a_restarted_engine_whose_resync_failed_is_not_served_until_a_resync_succeeds(two_engines):
    fleet, manager = two_engines
    import ray

    old_url, pid = fleet.engine_urls[1], fleet.server_pids()[1][0]
    resyncs = []

    def resync_failing_once(urls):
        resyncs.append((list(urls), finished(urls[0])))
        if len(resyncs) == 1:
            raise RuntimeError("weight push failed")

    os.kill(pid, signal.SIGKILL)
    _wait_dead(pid)
    fleet.on_restart = resync_failing_once
    try:
        with pytest.raises(RuntimeError, match="weight push failed"):
            fleet.recover(wait=True)
        (new_url,), _ = resyncs[0]
        # up, but without the current weights: neither routed to nor a direct target
        assert new_url != old_url and new_url not in fleet.live_urls()
        assert ray.get(fleet.router.workers.remote()) == [fleet.engine_urls[0]]
        # the next call is served by engine 0 alone; its end repeats the resync, then routes to it
        rows = manager.generate(prompt_batch(MANY_PROMPTS), SamplingSpec(n=2, max_new_tokens=2))
    finally:
        fleet.on_restart = None
    assert len(rows) == len(MANY_PROMPTS) * 2
    assert resyncs[1] == ([new_url], 0)  # the engine had served nothing before its weights came
    assert new_url in fleet.live_urls() and fleet.engine_urls[1] == new_url
    assert sorted(ray.get(fleet.router.workers.remote())) == sorted(fleet.engine_urls)


def test_a_free_port_is_never_one_a_predecessor_had(monkeypatch):
    from megarl.procs import net

    offered = iter([41000, 41000, 41001])

    class Socket:
        def __init__(self, *args):
            self.port = next(offered)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def bind(self, address):
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(net.socket, "socket", Socket)
    assert net.free_port("127.0.0.1", avoid={41000}) == 41001
