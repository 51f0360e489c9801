"""Resource pools and where every actor rank and rollout engine node sits.

    plan = plan_placement(cfg)                      # pure: pools, slots, engine nodes
    pools = {name: ResourcePool(spec) for name, spec in plan.pools.items()}
    pg, bundle = pools["actor"].bundle_of(plan.actor_slots[rank])

A pool is a number of devices spread over nodes of `devices_per_node` devices; on Ray it is one
STRICT_PACK placement group per node with one bundle per device, so a slot (node, bundle) names
the same device every time (verl's RayResourcePool does the same). A device is a GPU, or on a
machine without CUDA the custom resource `megarl_device`, which a local cluster declares, so the
same placement code runs on a laptop. Colocated: the engines use the actor pool's devices and
their launchers sit in the same bundles as the actor ranks; disaggregated: a second pool. A
classifier reward model (reward.model.kind=classifier) has ranks on the actor pool's first devices
(reward.model.placement=colocated) or a pool of its own, "reward".
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_DEVICE_RESOURCE = "megarl_device"
# An actor rank takes most of its device; a launcher takes a sliver of the first device of its
# engine node, so on GPU Ray tells it which physical GPU that bundle is (probes read the others).
RANK_DEVICE_SHARE = 0.9
LAUNCHER_DEVICE_SHARE = 0.01
# A critic rank shares its actor rank's device (colocated groups take turns on it, each offloading
# what it does not need); a sliver is enough for Ray to give it the same GPU.
CRITIC_DEVICE_SHARE = 0.05
# A colocated reward-model rank: a sliver too, leaving room for an actor rank, a critic rank and
# an engine launcher in the same bundle (0.9 + 0.05 + 0.04 + 0.01 = 1).
REWARD_MODEL_DEVICE_SHARE = 0.04


@dataclass(frozen=True)
class Slot:
    pool: str
    device: int  # index within the pool
    node: int  # node (placement group) index within the pool
    bundle: int  # bundle index within that node's placement group


@dataclass(frozen=True)
class PoolSpec:
    name: str
    num_devices: int
    devices_per_node: int

    @property
    def node_sizes(self) -> list[int]:
        full, rest = divmod(self.num_devices, self.devices_per_node)
        return [self.devices_per_node] * full + ([rest] if rest else [])

    def slot(self, device: int) -> Slot:
        if not 0 <= device < self.num_devices:
            raise IndexError(f"pool {self.name!r} has devices 0..{self.num_devices - 1}, not {device}")
        node, bundle = divmod(device, self.devices_per_node)
        return Slot(self.name, device, node, bundle)


@dataclass(frozen=True)
class EngineNode:
    """One node of one rollout engine: its ranks sit on `slots` (consecutive devices)."""

    engine: int
    node_rank: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class PlacementPlan:
    pools: dict[str, PoolSpec]
    actor_slots: list[Slot]
    engines: list[list[EngineNode]]  # [engine][node_rank]
    colocated: bool
    reward_slots: tuple[Slot, ...] = ()  # the classifier reward model's ranks (none without one)

    def describe(self) -> str:
        pools = ", ".join(
            f"{p.name}: {p.num_devices} devices ({'+'.join(map(str, p.node_sizes))} per node)"
            for p in self.pools.values()
        )
        mode = "colocated" if self.colocated else "disaggregated"
        shape = f"{len(self.engines)} engine(s) x {sum(len(n.slots) for n in self.engines[0])} devices"
        return f"{mode}; {pools}; rollout {shape}"


def plan_placement(cfg) -> PlacementPlan:
    """Pure function of a validated RunConfig: which device of which pool every rank uses."""
    c, r = cfg.cluster, cfg.rollout
    actor_pool_size = c.num_actor_ranks
    per_node = c.devices_per_node or max(actor_pool_size, r.num_servers * r.tp, c.num_rollout_devices or 0)
    actor = PoolSpec("actor", actor_pool_size, per_node)
    pools = {"actor": actor}
    if c.placement == "colocated":
        rollout = actor
    else:
        rollout = PoolSpec("rollout", c.num_rollout_devices or r.num_servers * r.tp, per_node)
        pools["rollout"] = rollout
    ranks_per_node = r.tp // r.nnodes
    engines = [
        [
            EngineNode(e, k, tuple(rollout.slot(e * r.tp + k * ranks_per_node + i) for i in range(ranks_per_node)))
            for k in range(r.nnodes)
        ]
        for e in range(r.num_servers)
    ]
    return PlacementPlan(
        pools,
        [actor.slot(i) for i in range(actor_pool_size)],
        engines,
        colocated=c.placement == "colocated",
        reward_slots=_reward_slots(cfg, pools, per_node),
    )


def _reward_slots(cfg, pools: dict[str, PoolSpec], per_node: int) -> tuple[Slot, ...]:
    """The classifier reward model's ranks: on the actor pool's first devices, or on a pool of
    their own (added to `pools`)."""
    m = cfg.reward.model
    if m.kind != "classifier":
        return ()
    if m.placement == "colocated":
        return tuple(pools["actor"].slot(i) for i in range(m.num_workers or pools["actor"].num_devices))
    pools["reward"] = PoolSpec("reward", m.num_workers or 1, per_node)
    return tuple(pools["reward"].slot(i) for i in range(pools["reward"].num_devices))


def device_resource() -> str:
    """GPUs where the Ray cluster has them, else the custom CPU device resource."""
    import ray

    return "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else CPU_DEVICE_RESOURCE


class ResourcePool:
    """A PoolSpec reserved on Ray: one STRICT_PACK placement group per node."""

    def __init__(self, spec: PoolSpec, resource: str, timeout_s: float = 60.0):
        import ray
        from ray.util.placement_group import placement_group

        self.spec, self.resource = spec, resource
        self.groups = [
            placement_group(
                [{resource: 1.0} for _ in range(size)], strategy="STRICT_PACK", name=f"megarl_{spec.name}_node{i}"
            )
            for i, size in enumerate(spec.node_sizes)
        ]
        try:
            ray.get([pg.ready() for pg in self.groups], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.remove()
            raise TimeoutError(
                f"could not reserve the {spec.name} pool ({spec.num_devices} x {resource!r} over nodes of "
                f"{spec.devices_per_node}) within {timeout_s:.0f}s; the cluster has "
                f"{ray.cluster_resources()}. On a CPU cluster start Ray with "
                f"--resources '{{\"{CPU_DEVICE_RESOURCE}\": N}}' on every node."
            ) from None

    def bundle_of(self, slot: Slot):
        if slot.pool != self.spec.name:
            raise ValueError(f"slot of pool {slot.pool!r} asked of pool {self.spec.name!r}")
        return self.groups[slot.node], slot.bundle

    def remove(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():
            for pg in self.groups:
                remove_placement_group(pg)
        self.groups = []


def scheduling(pool: ResourcePool, slot: Slot):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg, bundle = pool.bundle_of(slot)
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)


def gpu_ids_of(pool: ResourcePool, slots) -> list[str]:
    """Physical GPU ids behind `slots` (GPU pools only), read by a sliver-sized probe in each
    bundle: an engine launcher hands them to its server as CUDA_VISIBLE_DEVICES."""
    import ray

    if pool.resource != "GPU":
        return []

    @ray.remote(num_cpus=0, num_gpus=LAUNCHER_DEVICE_SHARE)
    def probe():
        return [str(i) for i in ray.get_gpu_ids()]

    found = ray.get([probe.options(scheduling_strategy=scheduling(pool, s)).remote() for s in slots])
    return [gpu for ids in found for gpu in ids]


def pool_for_engines(pools: dict[str, ResourcePool]) -> ResourcePool:
    return pools.get("rollout", pools["actor"])
