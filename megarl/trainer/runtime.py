"""Bring up (and always tear down) what a run needs: model files, data, Ray, servers, workers.

Everything is entered on one ExitStack, so an exception, Ctrl-C or SIGTERM at any point stops
exactly what was started, in reverse order: workers, servers, then the Ray cluster.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from megarl.config.schema import RunConfig
from megarl.engine.megatron.actor import ActorLossSpec, MegatronActor
from megarl.engine.megatron.engine import EngineSpec


@dataclass
class Runtime:
    cfg: RunConfig
    run_dir: Path
    model_path: str
    tokenizer: object
    train_data: object
    val_data: object
    actor: object  # RayWorkerGroup of MegatronActor
    rollout: object  # RolloutManager
    server_urls: list[str]


def run_dir_of(cfg: RunConfig) -> Path:
    return Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name


def resolve_model_path(cfg: RunConfig, run_dir: Path) -> str:
    if cfg.model.path is not None:
        if not (Path(cfg.model.path) / "config.json").exists():
            raise FileNotFoundError(f"model.path={cfg.model.path}: no config.json there; point it "
                                    "at a Hugging Face checkpoint directory")
        return cfg.model.path
    from megarl.models.tiny import build_tiny_checkpoint

    return str(build_tiny_checkpoint(run_dir / "init_model", seed=cfg.model.seed))


def engine_spec(cfg: RunConfig, model_path: str) -> EngineSpec:
    return EngineSpec(model_path=model_path, parallel=cfg.actor.parallel, optim=cfg.actor.optim,
                      micro_batch_size=cfg.actor.micro_batch_size, seed=cfg.actor.seed)


def loss_spec(cfg: RunConfig) -> ActorLossSpec:
    a = cfg.actor
    return ActorLossSpec(clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
                         loss_agg_mode=a.loss_agg_mode, use_kl_loss=a.use_kl_loss,
                         kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type,
                         entropy_coeff=a.entropy_coeff)


# Ray's CPU count is a scheduling budget, not a pin: a fraction of a CPU per Megatron rank leaves
# room for the rollout server and the driver on a laptop.
CPUS_PER_RANK = 0.5


@contextlib.contextmanager
def start_runtime(cfg: RunConfig):
    """Yield a Runtime for `cfg`; on exit stop every process it started."""
    from transformers import AutoTokenizer

    from megarl.controller.cluster import RayCluster
    from megarl.controller.worker_group import RayWorkerGroup
    from megarl.data.dataset import build_datasets
    from megarl.rollout.launcher import RolloutServerProcess
    from megarl.rollout.manager import RolloutManager

    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model_path(cfg, run_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_data, val_data = build_datasets(cfg.data, tokenizer, run_dir / "data")

    with contextlib.ExitStack() as stack:
        servers = []
        if cfg.rollout.backend != "embedded":
            raise NotImplementedError("rollout.backend=sglang: launching SGLang servers is not "
                                      "implemented yet; use rollout.backend=embedded")
        for i in range(cfg.rollout.num_servers):
            server = RolloutServerProcess(
                model_path, host=cfg.rollout.host,
                port=cfg.rollout.port + i if cfg.rollout.port else 0,
                max_batch_size=cfg.rollout.max_batch_size, seed=cfg.trainer.seed + i,
                torch_threads=1, log_path=run_dir / f"rollout_server_{i}.log")
            stack.enter_context(server)
            servers.append(server)
        urls = [s.url for s in servers]
        rollout = RolloutManager(urls, timeout_s=cfg.rollout.request_timeout_s,
                                 max_retries=cfg.rollout.max_retries)
        stack.callback(rollout.close)

        stack.enter_context(RayCluster(cfg.cluster.address, num_cpus=cfg.cluster.num_cpus)
                            if cfg.cluster.address is None else RayCluster(cfg.cluster.address))
        with_ref = bool(cfg.ref.enabled)
        actor = RayWorkerGroup(
            MegatronActor, cfg.cluster.num_actor_ranks,
            init_args=(engine_spec(cfg, model_path), loss_spec(cfg), with_ref),
            num_cpus_per_worker=CPUS_PER_RANK,
            env_vars={"MEGARL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                      "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore")},
            name_prefix="actor",
        )
        stack.callback(actor.shutdown)
        yield Runtime(cfg=cfg, run_dir=run_dir, model_path=model_path, tokenizer=tokenizer,
                      train_data=train_data, val_data=val_data, actor=actor, rollout=rollout,
                      server_urls=urls)
