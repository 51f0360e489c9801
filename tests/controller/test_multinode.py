"""A real two-node Ray cluster on one machine (two raylets, ray.cluster_utils): a resource pool of
one device per node, and a tp=2 engine over 2 nodes whose launcher actors land on different Ray
nodes, rendezvous through node 0's address, and serve like a one-node engine."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megarl.data.batch import Batch
from megarl.rollout.client.manager import RolloutManager, SamplingSpec
from megarl.rollout.fleet.engine_launcher import EngineNodeSpec
from megarl.rollout.fleet.fleet import RolloutFleet

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster

    from megarl.controller.cluster import RayCluster
    from megarl.controller.placement import CPU_DEVICE_RESOURCE

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {CPU_DEVICE_RESOURCE: 1}})
    try:
        cluster.add_node(num_cpus=1, resources={CPU_DEVICE_RESOURCE: 1})
        cluster.wait_for_nodes()
        with RayCluster(cluster.address, log_to_driver=False):
            yield cluster
    finally:
        cluster.shutdown()


def test_engine_over_two_ray_nodes(two_node_cluster, tiny_model_path, tmp_path):
    import ray

    from megarl.controller.placement import (
        CPU_DEVICE_RESOURCE,
        LAUNCHER_DEVICE_SHARE,
        PoolSpec,
        ResourcePool,
        scheduling,
    )

    pool = ResourcePool(PoolSpec("rollout", 2, 1), CPU_DEVICE_RESOURCE)  # one placement group per node
    specs = [
        [
            EngineNodeSpec(
                backend="embedded",
                model_path=str(tiny_model_path),
                engine=0,
                node_rank=k,
                nnodes=2,
                tp=2,
                log_path=str(tmp_path / f"node{k}.log"),
            )
            for k in range(2)
        ]
    ]
    fleet = RolloutFleet(
        specs,
        api_key="k",
        placement=lambda e, k: {
            "scheduling_strategy": scheduling(pool, pool.spec.slot(k)),
            "resources": {pool.resource: LAUNCHER_DEVICE_SHARE},
        },
    )
    with contextlib.ExitStack() as stack:
        stack.callback(pool.remove)
        stack.callback(fleet.close)
        fleet.start()
        nodes = ray.get([launcher.node_id.remote() for launcher in fleet.engines[0].launchers])
        assert len(set(nodes)) == 2, "the two nodes of the engine should run on two Ray nodes"
        manager = RolloutManager(fleet=fleet, timeout_s=60, api_key="k")
        stack.callback(manager.close)
        prompts = Batch(non_tensors={"raw_prompt_ids": [[2, 10, 11, 3], [2, 20, 3]]})
        rows = manager.generate(prompts, SamplingSpec(n=2, max_new_tokens=4))
        assert len(rows) == 4 and (rows["response_mask"].sum(-1) > 0).all()
