"""Bring up (and always tear down) what a run needs: model files, data, Ray, servers, workers.

Everything is entered on one ExitStack, so an exception, Ctrl-C or SIGTERM at any point stops
exactly what was started, in reverse order: workers, servers, then the Ray cluster.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.config.schema import RunConfig
from megarl.controller.shm_leftovers import record_ranks, remove_recorded_leftovers
from megarl.engine.megatron.actor import ActorLossSpec, MegatronActor
from megarl.engine.megatron.critic import MegatronCritic
from megarl.procs.net import get_node_ip
from megarl.trainer.reward_workers import reward_model_path, start_reward_workers

# the worker groups' engine and loss specs (importable from here as before)
from megarl.trainer.specs import (  # noqa: F401
    critic_engine_spec,
    critic_loss_spec,
    engine_spec,
    lora_spec,
    loss_spec,
    prm_engine_spec,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megarl.controller.placement import PlacementPlan
    from megarl.controller.worker_group import RayWorkerGroup
    from megarl.data.dataset import RLDataset
    from megarl.data.mix import MixedDataset
    from megarl.reward.classifier import ClassifierWorkers
    from megarl.rollout.client.manager import RolloutManager
    from megarl.rollout.fleet.fleet import RolloutFleet

# every worker rank's environment: ranks share the node's cores
RANK_ENV = {
    "MEGARL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore"),
}
RANKS_FILE = "ranks.json"  # this run's local rank pids (shm_leftovers: a later run here cleans up after them)


@dataclass
class Runtime:
    """Everything a loop talks to, started by start_runtime and stopped when it exits."""

    cfg: RunConfig
    run_dir: Path
    model_path: str
    tokenizer: PreTrainedTokenizerBase
    train_data: RLDataset | MixedDataset
    val_data: RLDataset | MixedDataset | None
    actor: RayWorkerGroup  # of MegatronActor
    rollout: RolloutManager
    fleet: RolloutFleet  # the engines (and router) the rollout talks to
    placement: PlacementPlan
    critic: RayWorkerGroup | None = None  # of MegatronCritic (critic.enabled)
    prm: RayWorkerGroup | None = None  # of MegatronPRM (algorithm.adv_estimator=prime)
    reward_model_url: str | None = None  # the embedded judge server (reward.model genrm without url)
    reward_workers: ClassifierWorkers | None = None  # the classifier reward model's ranks
    startup: dict[str, float] | None = None  # seconds per start-up phase (StartupClock), in order

    @property
    def server_urls(self) -> list[str]:
        """Every engine's own URL (weight updates and control calls never go through the router)."""
        return self.fleet.engine_urls


class StartupClock:
    """Seconds per start-up phase, for the run's first line: what a user waits for before step 1.
    The engines start with the actor ranks (fleet.launch); engines_after_ranks is the wait left."""

    def __init__(self):
        import time

        self._now = time.perf_counter
        self._last = self._now()
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = self._now()
        self.phases[phase] = now - self._last
        self._last = now

    @staticmethod
    def describe(phases: dict[str, float]) -> str:
        return f"{sum(phases.values()):.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()) + ")"


def run_dir_of(cfg: RunConfig) -> Path:
    return Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name


def resolve_model_path(cfg: RunConfig, run_dir: Path) -> str:
    if cfg.model.path is not None:
        if not (Path(cfg.model.path) / "config.json").exists():
            raise FileNotFoundError(
                f"model.path={cfg.model.path}: no config.json there; point it at a Hugging Face checkpoint directory"
            )
        return cfg.model.path
    from megarl.models import smollm2

    if cfg.model.preset == smollm2.PRESET:
        return str(smollm2.materialize())
    from megarl.models import tiny_vlm

    if cfg.model.preset == tiny_vlm.PRESET:  # a vision-language model: its text part's depth
        text = {"num_hidden_layers": cfg.model.num_hidden_layers} if cfg.model.num_hidden_layers else None
        return str(tiny_vlm.build_tiny_vlm_checkpoint(run_dir / "init_model", seed=cfg.model.seed, text=text))
    from megarl.models.tiny import build_tiny_checkpoint, preset_overrides

    return str(
        build_tiny_checkpoint(
            run_dir / "init_model", seed=cfg.model.seed, preset=cfg.model.preset, **preset_overrides(cfg.model)
        )
    )


def engine_node_specs(cfg: RunConfig, model_path: str, run_dir: Path) -> list[list]:
    from megarl.rollout.fleet.engine_launcher import EngineNodeSpec

    r = cfg.rollout
    return [
        [
            EngineNodeSpec(
                backend=r.backend,
                model_path=model_path,
                engine=e,
                node_rank=k,
                nnodes=r.nnodes,
                tp=r.tp,
                ep=r.ep,
                dp=r.dp,
                host=r.host,
                port=r.port + e * r.nnodes + k if r.port else 0,
                max_batch_size=r.max_batch_size,
                torch_threads=r.torch_threads,
                seed=cfg.trainer.seed + e,
                colocated=cfg.cluster.placement == "colocated",
                mem_fraction_static=r.mem_fraction_static,
                routed_experts=cfg.actor.moe.routing_replay,
                **_lora_launch(cfg),
                log_path=str(
                    run_dir / (f"rollout_server_{e}.log" if r.nnodes == 1 else f"rollout_server_{e}_node{k}.log")
                ),
                startup_timeout_s=r.startup_timeout_s,
                env={"TOKENIZERS_PARALLELISM": "false"},
                # where the disk transport writes (Trainer._bridge_spec): the only dir disk updates may read
                weight_dirs=(str(run_dir / "weights"),),
            )
            for k in range(r.nnodes)
        ]
        for e in range(r.num_servers)
    ]


def _lora_launch(cfg: RunConfig) -> dict:
    """The engines' LoRA launch options: with bridge.transport=adapter they load the policy's
    adapter at run time (SGLang needs its rank and target modules up front)."""
    lora = cfg.actor.lora
    if cfg.bridge.transport != "adapter":
        return {}
    targets = (
        ("all",) if "all-linear" in lora.target_modules else tuple(t.rsplit(".", 1)[-1] for t in lora.target_modules)
    )
    return {"lora_rank": lora.rank, "lora_target_modules": targets}


def build_fleet(cfg: RunConfig, plan, pools: dict, model_path: str, run_dir: Path):
    import secrets

    from megarl.controller.placement import LAUNCHER_DEVICE_SHARE, gpu_ids_of, pool_for_engines, scheduling
    from megarl.rollout.fleet.fleet import RolloutFleet, RouterSpec

    pool = pool_for_engines(pools)
    share = (
        {"num_gpus": LAUNCHER_DEVICE_SHARE}
        if pool.resource == "GPU"
        else {"resources": {pool.resource: LAUNCHER_DEVICE_SHARE}}
    )

    def placement(e: int, k: int) -> dict:
        return {"scheduling_strategy": scheduling(pool, plan.engines[e][k].slots[0]), **share}

    router = None
    if cfg.rollout.router:
        router = RouterSpec(
            policy=cfg.rollout.router_policy, host=cfg.rollout.host, log_path=str(run_dir / "router.log")
        )
    return RolloutFleet(
        engine_node_specs(cfg, model_path, run_dir),
        # every run gets its own key, whatever the host: engines bound beyond loopback
        # require one, and one code path for all runs keeps that path tested
        api_key=secrets.token_urlsafe(32),
        router=router,
        placement=placement,
        gpu_ids=lambda e, k: gpu_ids_of(pool, plan.engines[e][k].slots),
        request_timeout_s=cfg.rollout.request_timeout_s,
        max_restarts=cfg.rollout.max_engine_restarts,
    )


def cluster_for(cfg: RunConfig, plan=None):
    """The RayCluster a run starts (cluster.address None: a local one declaring its CPU "devices")
    or joins. Not started: `start_runtime` enters it, `train` starts it early in the background."""
    from megarl.controller.cluster import RayCluster
    from megarl.controller.placement import CPU_DEVICE_RESOURCE, plan_placement

    if cfg.cluster.address is not None:
        return RayCluster(cfg.cluster.address)
    plan = plan or plan_placement(cfg)
    devices = {CPU_DEVICE_RESOURCE: float(sum(p.num_devices for p in plan.pools.values()))}
    return RayCluster(num_cpus=cfg.cluster.num_cpus, resources=devices)


@contextlib.contextmanager
def start_runtime(cfg: RunConfig, cluster=None):
    """Yield a Runtime for `cfg`; on exit stop every process it started. `cluster`: a
    cluster_for(cfg) already starting in the background (train), else one is started here."""
    from megarl.controller.placement import plan_placement

    clock = StartupClock()
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    plan = plan_placement(cfg)

    with contextlib.ExitStack() as stack:
        if cluster is None:
            cluster = cluster_for(cfg, plan)
            cluster.start(background=True)  # Ray comes up while the model, tokenizer and data are built
        stack.push(cluster.__exit__)  # stops what it started (also a start still under way)
        from transformers import AutoTokenizer

        from megarl.data.build import build_datasets
        from megarl.trainer.vision import image_limits, prompt_images

        model_path = resolve_model_path(cfg, run_dir)
        reward_path = reward_model_path(cfg, run_dir)  # a classifier's (a preset is built now)
        clock.mark("model")
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        limits = image_limits(model_path, tokenizer)  # None: a text model
        train_data, val_data = build_datasets(cfg.data, tokenizer, run_dir / "data", image_limits=limits)
        clock.mark("data")
        pools, resource, record = reserve_pools(plan, run_dir, cluster, stack, clock)
        fleet = build_fleet(cfg, plan, pools, model_path, run_dir)
        stack.callback(fleet.close)
        fleet.launch()  # engines start while the Megatron ranks initialise
        actor, critic, prm = worker_groups(cfg, plan, pools, resource, model_path, stack, clock)
        reward_workers = start_reward_workers(cfg, plan, pools, resource, reward_path, RANK_ENV, stack)
        ranks = [g.processes for g in (actor, critic, prm, reward_workers and reward_workers.group) if g]
        record([p for group in ranks for p in group])
        from megarl.reward.model import reward_model_server

        reward_model_url = stack.enter_context(reward_model_server(cfg.reward.model, run_dir))
        clock.mark("critic_and_reward_model")
        fleet.wait_started()
        clock.mark("engines_after_ranks")
        rollout = _rollout_manager(cfg, fleet, tokenizer, stack, prompt_images(model_path) if limits else None)
        yield Runtime(
            cfg=cfg,
            run_dir=run_dir,
            model_path=model_path,
            tokenizer=tokenizer,
            train_data=train_data,
            val_data=val_data,
            actor=actor,
            rollout=rollout,
            fleet=fleet,
            placement=plan,
            critic=critic,
            prm=prm,
            reward_model_url=reward_model_url,
            reward_workers=reward_workers,
            startup=clock.phases,
        )


def reserve_pools(plan, run_dir: Path, cluster, stack, clock, names: tuple[str, ...] | None = None):
    """Wait for Ray, clean up after an earlier run here that was killed outright, and reserve the
    plan's pools (`names`: only those), each released by `stack`. Returns (pools, the device
    resource, record): record(processes) notes the ranks' pids for the next run here."""
    from megarl.controller.placement import ResourcePool, device_resource

    cluster.wait_started()
    clock.mark("ray")  # the wait left for Ray after the model and data
    here, ranks_file = get_node_ip(), run_dir / RANKS_FILE  # Ray's view of this node from here on
    still_running = remove_recorded_leftovers(ranks_file, here)  # an earlier run here killed outright?
    stack.callback(remove_recorded_leftovers, ranks_file, here)  # at exit, after the ranks' shutdown
    resource = device_resource()
    pools = {}
    for name, spec in plan.pools.items():
        if names is None or name in names:
            pools[name] = ResourcePool(spec, resource)
            stack.callback(pools[name].remove)
    return pools, resource, lambda processes: record_ranks(ranks_file, processes, here, still_running)


def worker_groups(
    cfg: RunConfig, plan, pools: dict, resource: str, model_path: str, stack, clock, loss: ActorLossSpec | None = None
):
    """The actor's Megatron ranks (with the reference when ref.enabled) and, with critic.enabled,
    the critic's (with algorithm.adv_estimator=prime, the PRM's) on the same devices; each shut
    down by `stack`. `loss`: the actor's alone, with neither reference, critic nor PRM (`megarl
    sft`); None: the RL run's (loss_spec(cfg)). Returns (actor, critic or None, PRM or None)."""
    from megarl.controller.placement import CRITIC_DEVICE_SHARE, RANK_DEVICE_SHARE
    from megarl.controller.worker_group import RayWorkerGroup

    with_ref = bool(cfg.ref.enabled) and loss is None

    def device_share(share: float) -> dict:
        return {"num_gpus_per_worker": share} if resource == "GPU" else {"resources_per_worker": {resource: share}}

    actor_bundles = [pools["actor"].bundle_of(s) for s in plan.actor_slots]
    actor = RayWorkerGroup(
        MegatronActor,
        cfg.cluster.num_actor_ranks,
        init_args=(engine_spec(cfg, model_path), loss or loss_spec(cfg), with_ref),
        init_kwargs={"offload": cfg.actor.offload, "ref_offload": cfg.ref.offload},
        num_cpus_per_worker=0,
        bundles=actor_bundles,
        env_vars=RANK_ENV,
        name_prefix="actor",
        **device_share(RANK_DEVICE_SHARE),
    )
    stack.callback(actor.shutdown)
    clock.mark("actor_ranks")

    def colocated(cls, name: str, init_args: tuple, offload):
        """A worker group of its own mesh on the actor ranks' devices (the critic, the PRM)."""
        group = RayWorkerGroup(
            cls,
            cfg.cluster.num_actor_ranks,
            init_args=init_args,
            init_kwargs={"offload": offload},
            num_cpus_per_worker=0,
            bundles=actor_bundles,
            env_vars=RANK_ENV,
            name_prefix=name,
            **device_share(CRITIC_DEVICE_SHARE),
        )
        stack.callback(group.shutdown)
        return group

    critic = prm = None
    if cfg.critic.enabled and loss is None:
        critic_args = (critic_engine_spec(cfg, model_path), critic_loss_spec(cfg))
        critic = colocated(MegatronCritic, "critic", critic_args, cfg.critic.offload)
    if cfg.algorithm.adv_estimator == "prime" and loss is None:
        from megarl.algo.sequence_losses import SequenceLossConfig
        from megarl.engine.megatron.prm import MegatronPRM

        prm_args = (prm_engine_spec(cfg, model_path), SequenceLossConfig(prm_beta=cfg.algorithm.prime.beta))
        prm = colocated(MegatronPRM, "prm", prm_args, cfg.prm.offload)
    return actor, critic, prm


def _rollout_manager(cfg: RunConfig, fleet, tokenizer, stack, vision=None):
    """The trainer's side of rollout over the fleet's engines (with the agent loop when configured)."""
    from megarl.rollout.agent.rollout import AgentRollout
    from megarl.rollout.client.manager import RolloutManager

    rollout = RolloutManager(
        fleet=fleet,
        timeout_s=cfg.rollout.request_timeout_s,
        max_retries=cfg.rollout.max_retries,
        api_key=fleet.api_key,
        agent=AgentRollout.from_config(cfg.rollout, tokenizer),
        vision=vision,
    )
    stack.callback(rollout.close)
    return rollout
