"""Weight sync per transport, predicted (megarl/perf/sync_model.py) next to the published syncs.

    .venv/bin/python benchmarks/bench_sync_plan.py [--smoke]

(--smoke prints the same: the script is a few seconds of planning, no run.)

Prints markdown for benchmarks/RESULTS.md ("Weight sync per transport"): each published sync row
of benchmarks/published_runs.yaml (verl's Qwen3-30B-A3B and Qwen3-235B-A22B with and without its
bucketed checkpoint engine, slime's colocated Qwen3-30B-A3B, NeMo-RL's DeepSeek-V3 shard-to-shard
refit) as overrides of the scale configs, with the transport that moves weights the way that
system did; then every transport on configs/deepseek-v3-671b.yaml as shipped (256 x H100).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# overrides of the scale configs, one string each (split on spaces)
_VERL_30B = (  # 2 GiB: verl's checkpoint-engine bucket default
    "cluster.placement=disaggregated cluster.num_actor_ranks=16 cluster.num_rollout_devices=16 "
    "actor.parallel.cp=2 rollout.num_servers=4 rollout.tp=4 rollout.release_memory=null bridge.bucket_size_mb=2048"
).split()
_VERL_235B = (  # 11 + 6 * 12 + 11 = 94 layers
    "cluster.placement=disaggregated cluster.num_actor_ranks=64 cluster.num_rollout_devices=64 "
    "actor.parallel.tp=4 actor.parallel.pp=8 actor.parallel.ep=4 actor.parallel.first_stage_layers=11 "
    "actor.parallel.last_stage_layers=11 actor.ppo_mini_batch_size=64 rollout.num_servers=8 rollout.tp=8 "
    "rollout.release_memory=null bridge.bucket_size_mb=2048"
).split()
# PP16 x EP16 -> vLLM TP32 x DP8 (experts sliced by tp: ep 1), colocated
_NEMO_DSV3 = "actor.parallel.tp=1 actor.parallel.sequence_parallel=false rollout.ep=1 rollout.dp=1".split()

# name, base config, overrides, devices, transport, price each tensor alone, published s, row id
ROWS = [
    ("verl Qwen3-30B-A3B 16 -> 16 H20, NCCL per tensor", "qwen3-30b-a3b", _VERL_30B, "32xH20",
     "distributed", True, 15.76, "verl-qwen3-30b-a3b-sync-16to16xH20 sync_s"),
    ("the same, checkpoint engine (2 GiB buckets)", "qwen3-30b-a3b", _VERL_30B, "32xH20",
     "distributed", False, 4.38, "sync_s_checkpoint_engine"),
    ("verl Qwen3-235B-A22B 64 -> 64 H20, NCCL per tensor", "qwen3-235b-a22b", _VERL_235B, "128xH20",
     "distributed", True, 58.57, "verl-qwen3-235b-a22b-sync-64to64xH20 sync_s"),
    ("the same, checkpoint engine (2 GiB buckets)", "qwen3-235b-a22b", _VERL_235B, "128xH20",
     "distributed", False, 23.70, "sync_s_checkpoint_engine"),
    ("slime Qwen3-30B-A3B, 8 H100 colocated, CUDA IPC buckets", "qwen3-30b-a3b",
     ["cluster.num_actor_ranks=8", "actor.parallel.tp=4", "rollout.num_servers=1", "rollout.tp=8",
      "rollout.ep=8", "bridge.bucket_size_mb=512"], "8xH100",
     "tensor", False, 7.0, "slime-qwen3-30b-a3b-sync-8xH100-colocated sync_s"),
    ("NeMo-RL DeepSeek-V3, 256 H100, nccl_reshard", "deepseek-v3-671b", _NEMO_DSV3, "256xH100",
     "reshard", False, 2.39, "docs/bridge.md; shared reference: 2.39-2.83 s"),
]  # fmt: skip


def _predict(base: str, overrides: list[str], devices: str, alone: bool):
    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.perf.hardware import parse_devices
    from megarl.perf.memory import rollout_memory
    from megarl.perf.steptime import efficiency_of
    from megarl.perf.sync_model import predict

    cfg = validate(load_config(str(ROOT / "configs" / f"{base}.yaml"), overrides))
    hf = json.loads((ROOT / cfg.model.path / "config.json").read_text())
    _, device = parse_devices(devices)
    return predict(cfg, hf, device, rollout_memory(cfg, hf, device), efficiency_of(device), alone=alone)


def _terms(t) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.2g}" for k, v in t.terms_s.items() if v)


def published() -> None:
    print("| published sync | transport priced | published s | predicted s | error | bound (terms, s) |")
    print("|---|---|---:|---:|---:|---|")
    for name, base, over, devices, transport, alone, value, _ in ROWS:
        t = _predict(base, over, devices, alone)[transport]
        label = transport + (" (each tensor alone)" if alone else "")
        print(
            f"| {name} | {label} | {value:.3g} | {t.s:.3g} | {(t.s - value) / value:+.0%} | "
            f"{t.bound.replace('_', ' ')} ({_terms(t)}) |"
        )


def shipped() -> None:
    times = _predict("deepseek-v3-671b", [], "256xH100", False)
    print()
    print("| configs/deepseek-v3-671b.yaml, 256 x H100 | predicted s | bound | terms (s) | note |")
    print("|---|---:|---|---|---|")
    for name, t in times.items():
        if t.s is None:
            print(f"| {name} | - | - | - | {t.why} |")
            continue
        print(f"| {name} | {t.s:.3g} | {t.bound.replace('_', ' ')} | {_terms(t)} | {t.why or ''} |")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="the same tables (nothing to shorten)")
    ap.parse_args()
    published()
    shipped()
