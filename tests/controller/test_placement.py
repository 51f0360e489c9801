"""Placement plans (pure): which pool, node and bundle every actor rank and engine node uses."""

import pytest

from megarl.config import load_config, validate
from megarl.controller.placement import PoolSpec, Slot, plan_placement
from megarl.models.tiny import TINY_QWEN3_MOE

QUICKSTART = "configs/quickstart.yaml"


def plan(*overrides, model=TINY_QWEN3_MOE):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / QUICKSTART
    return plan_placement(validate(load_config(path, list(overrides)), dict(model)))


def test_pool_slots_fill_nodes_in_order():
    pool = PoolSpec("actor", 10, 4)
    assert pool.node_sizes == [4, 4, 2]
    assert pool.slot(0) == Slot("actor", 0, 0, 0)
    assert pool.slot(5) == Slot("actor", 5, 1, 1)
    assert pool.slot(9) == Slot("actor", 9, 2, 1)
    with pytest.raises(IndexError, match="pool 'actor' has devices 0..9"):
        pool.slot(10)


def test_colocated_engines_share_the_actor_pool_devices():
    p = plan("rollout.num_servers=2")
    assert list(p.pools) == ["actor"] and p.colocated
    assert [s.device for s in p.actor_slots] == [0, 1]
    assert [[n.slots for n in e] for e in p.engines] == [[(Slot("actor", 0, 0, 0),)], [(Slot("actor", 1, 0, 1),)]]
    assert p.describe().startswith("colocated; actor: 2 devices")


def test_disaggregated_tp2_engine_gets_its_own_pool():
    p = plan("cluster.placement=disaggregated", "rollout.tp=2")
    assert set(p.pools) == {"actor", "rollout"} and not p.colocated
    ((node,),) = p.engines
    assert node.node_rank == 0 and [s.pool for s in node.slots] == ["rollout", "rollout"]
    assert [s.device for s in node.slots] == [0, 1]


def test_multi_node_engines_take_consecutive_devices_one_node_each():
    p = plan(
        "cluster.placement=disaggregated",
        "rollout.tp=2",
        "rollout.nnodes=2",
        "rollout.num_servers=2",
        "cluster.devices_per_node=2",
        "cluster.num_actor_ranks=2",
    )
    assert p.pools["rollout"].node_sizes == [2, 2]
    layout = [[(n.node_rank, [(s.node, s.bundle) for s in n.slots]) for n in e] for e in p.engines]
    # engine 0: node rank 0 on device 0, node rank 1 on device 1; engine 1 on the second node
    assert layout == [[(0, [(0, 0)]), (1, [(0, 1)])], [(0, [(1, 0)]), (1, [(1, 1)])]]


def test_a_classifier_reward_model_takes_actor_devices_or_a_pool_of_its_own():
    rm = ("reward.model.kind=classifier", "reward.model.preset=tiny-digits-rm")
    assert plan().reward_slots == ()  # no classifier: no ranks
    colocated = plan(*rm)
    assert list(colocated.pools) == ["actor"] and colocated.reward_slots == tuple(colocated.actor_slots)
    assert plan(*rm, "reward.model.num_workers=1").reward_slots == (Slot("actor", 0, 0, 0),)
    own = plan(*rm, "reward.model.placement=disaggregated", "reward.model.num_workers=3", "cluster.devices_per_node=2")
    assert own.pools["reward"] == PoolSpec("reward", 3, 2)
    assert own.reward_slots == (Slot("reward", 0, 0, 0), Slot("reward", 1, 0, 1), Slot("reward", 2, 1, 0))
