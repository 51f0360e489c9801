"""The classifier reward model of a run (reward.model.kind=classifier): its checkpoint and its
worker group.

The checkpoint is reward.model.path, or reward.model.preset built in code at RUN_DIR/reward_model
(megarl/reward/rm_presets.py: trained on first use, reused while its recipe is unchanged). The
ranks sit where the placement plan put them (controller/placement.py): a sliver of each of the
actor pool's first devices, like the critic's ranks, or whole devices of the "reward" pool.
"""

from __future__ import annotations

from pathlib import Path

from megarl.config.schema import RunConfig


def reward_model_path(cfg: RunConfig, run_dir: Path, log=None) -> str | None:
    """The classifier's HF folder (built from its preset when needed); None without a classifier.
    `log(line)`: told when a preset is built."""
    m = cfg.reward.model
    if m.kind != "classifier":
        return None
    if m.path is not None:
        return m.path
    from megarl.reward.rm_presets import build_reward_model

    return str(build_reward_model(m.preset, run_dir / "reward_model", log=log))


def start_reward_workers(cfg: RunConfig, plan, pools: dict, resource: str, path: str | None, env: dict, stack):
    """The classifier's worker group on plan.reward_slots, shut down by `stack`; None without one."""
    if path is None:
        return None
    from megarl.controller.placement import RANK_DEVICE_SHARE, REWARD_MODEL_DEVICE_SHARE
    from megarl.controller.worker_group import RayWorkerGroup
    from megarl.reward.classifier import ClassifierWorkers
    from megarl.reward.classifier_worker import RewardModelWorker

    m = cfg.reward.model
    share = REWARD_MODEL_DEVICE_SHARE if m.placement == "colocated" else RANK_DEVICE_SHARE
    placement = {"num_gpus_per_worker": share} if resource == "GPU" else {"resources_per_worker": {resource: share}}
    group = RayWorkerGroup(
        RewardModelWorker,
        len(plan.reward_slots),
        init_args=(path, m.batch_size, m.dtype),
        num_cpus_per_worker=0,
        bundles=[pools[s.pool].bundle_of(s) for s in plan.reward_slots],
        env_vars=env,
        name_prefix="reward_model",
        **placement,
    )
    stack.callback(group.shutdown)
    return ClassifierWorkers(group, path, group.max_length())
