"""The cluster's nodes and devices: tensor-parallel groups inside a node, a device type the planner
knows (by name: devices.py)."""

from __future__ import annotations

from megarl.config.devices import canonical_device, known_device_types
from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def check_nodes(cfg: RunConfig) -> None:
    """Megatron numbers ranks tp fastest (order tp-cp-ep-dp-pp) and placement fills one node after
    another, so a tensor-parallel group stays inside a node exactly when tp divides the node's
    devices; across nodes its per-layer all-reduces would leave NVLink for the network."""
    per_node = cfg.cluster.devices_per_node
    if per_node is None or per_node < 1:
        return  # validate_rollout names a bad value
    sections = [("actor", cfg.actor.parallel)] + ([("critic", cfg.critic.parallel)] if cfg.critic.enabled else [])
    for section, p in sections:
        _require(
            per_node % p.tp == 0,
            f"{section}.parallel.tp",
            f"{section}.parallel.tp={p.tp} does not divide cluster.devices_per_node={per_node}: "
            "a tensor-parallel group would span nodes; lower tp (raise pp or ep instead)",
        )


def check_device_type(cfg: RunConfig) -> None:
    """cluster.device_type: a name the memory planner has figures for (megarl/perf/hardware.py)."""
    kind = cfg.cluster.device_type
    _require(
        kind is None or canonical_device(kind) is not None,
        "cluster.device_type",
        f"cluster.device_type={kind!r} is not a device the planner knows; use one of "
        f"{', '.join(known_device_types())} (or null: this host's)",
    )
