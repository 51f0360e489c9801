"""MoE routing replay on a GPU: the embedded engine records experts on CUDA, the Megatron engine
replays them on CUDA (one process, NCCL, world size 1, fp32 with TF32 off).

    python3 benchmarks/gpu_replay.py --out DIR [--smoke]

tests/engine/test_routing_replay.py's setting, moved to the GPU: the tiny Qwen3-MoE (expert down-projections
x8 so an expert flip moves the log-probs) serves 4 prompts x 2 samples with return_routed_experts
from a GenerationEngine on cuda; the trainer's copy has its router weights perturbed by N(0, 1e-2).
Checked: the trainer's log-probs without and with replay against Hugging Face float64 on the host
with the served experts forced (the independent reference; with replay expected < 1e-5), the
server-vs-trainer mismatch without and with replay, and one training step with replay (recompute
none and full: finite grad norm, equal up to 1e-5 relative; the router weights move). The
expectations (replay < 1e-5, grad norms, router) are the JSON's `checks`; the exit status is 1 when
one fails. --smoke runs it on the CPU (gloo) to check the script. On the device machine carry bench_gpu.py's wheels and
orjson's (megarl.rollout.client.client, which the served answers go through, imports it).
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import sys
import tempfile
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="where gpu_replay.json goes (default: .; --smoke: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="on the CPU (gloo)")
    args = ap.parse_args()
    args.out = args.out or (tempfile.mkdtemp(prefix="gpu_replay_smoke_") if args.smoke else ".")
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}
    try:
        result.update(run(device))
        result["checks"] = checks(result)
        result["ok"] = all(result["checks"].values())
    except Exception:
        result["ok"], result["error"] = False, traceback.format_exc()[-4000:]
    print(json.dumps(result, indent=1), flush=True)
    with open(os.path.join(args.out, "gpu_replay.json"), "w") as f:
        json.dump(result, f, indent=1)
    if not result["ok"]:
        sys.exit("gpu_replay: failed (a traceback or a False check above, and in gpu_replay.json)")


def checks(out: dict) -> dict:
    """The expectations the module doc states, each True or False."""
    norms = [out[f"train_{r}"]["grad_norm"] for r in ("none", "full")]
    return {
        "replayed trainer vs HF forced < 1e-5": out["replayed"]["vs_hf_forced_float64_max"] < 1e-5,
        "grad norms finite": all(math.isfinite(x) for x in norms),
        "recompute none vs full grad norm within 1e-5 relative": out["recompute_grad_norm_rel_diff"] <= 1e-5,
        "router weights moved": all(out[f"train_{r}"]["router_moved_max"] > 0 for r in ("none", "full")),
    }


def run(device: str) -> dict:
    import torch.distributed as dist

    from megarl.algo.kl import kl_penalty
    from megarl.algo.losses import masked_mean, policy_loss
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine
    from megarl.models.tiny import build_tiny_checkpoint
    from megarl.rollout.engine.generation import GenerationEngine
    from megarl.rollout.server.generate_input import parse_generate
    from megarl.rollout.server.generate_output import output_item
    from tests.engine.test_routing_replay import (
        PROMPTS,
        hf_forced_log_probs,
        served_batch,
        server_and_trainer_checkpoints,
    )

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29547")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    root = tempfile.mkdtemp(prefix="gpu_replay_")
    atexit.register(shutil.rmtree, root, True)
    base = build_tiny_checkpoint(os.path.join(root, "tiny"), seed=0)
    paths = [str(x) for x in server_and_trainer_checkpoints(base, root)]

    engine = GenerationEngine(paths[0], device=device, max_batch_size=16, seed=0)
    try:
        body = {
            "input_ids": PROMPTS,
            "return_logprob": True,
            "return_routed_experts": True,
            "sampling_params": {"n": 2, "max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3},
        }
        call = parse_generate(body, engine)
        results = [f.result(timeout=120) for f in engine.submit(call.requests)]
        items = [output_item(r, q, call, str) for r, q in zip(results, call.requests)]
    finally:
        engine.close()
    batch = served_batch({"items": items, "requests": call.requests})
    mask, rollout = batch["response_mask"], batch["rollout_log_probs"]

    def megatron(path, replay, train=False, recompute="none"):
        e = MegatronEngine(
            EngineSpec(
                model_path=path,
                parallel=ParallelConfig(),
                micro_batch_size=3,
                seed=1,
                optim=OptimConfig(lr=1e-3, adam_eps=1e-2, clip_grad=0.0) if train else None,
                routing_replay=replay,
                recompute=recompute,
            )
        )
        e.initialize()
        return e

    def diff(a, b):
        return float(((a.double() - b.double()).abs() * mask).max())

    without = batch.select(*[k for k in batch.keys() if k != "routed_experts"])
    out: dict = {"rows": len(batch), "response_tokens": int(mask.sum())}
    reference = hf_forced_log_probs(paths[1], batch)
    for replay in (False, True):
        lp = megatron(paths[1], replay).compute_log_prob(batch if replay else without)["log_probs"]
        name = "replayed" if replay else "free"
        out[name] = {
            "vs_hf_forced_float64_max": diff(lp, reference),
            "vs_server_max": diff(lp, rollout),
            "vs_server_mean": float(((lp - rollout).abs() * mask).sum() / mask.sum()),
            "k3_kl_server_trainer": float(masked_mean(kl_penalty(rollout, lp, "k3"), mask)),
        }
    same = megatron(paths[0], True).compute_log_prob(batch)["log_probs"]
    out["same_weights_replayed_vs_server_max"] = diff(same, rollout)
    batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None].expand_as(mask).contiguous()
    for recompute in ("none", "full"):
        e = megatron(paths[1], True, train=True, recompute=recompute)
        gates = lambda: {
            k: v.detach().float().cpu().clone() for k, v in e.export_weights() if k.endswith("mlp.gate.weight")
        }
        before = gates()

        def loss_fn(logp, ent, mb):
            loss, _ = policy_loss(logp, logp.detach(), mb["advantages"], mb["response_mask"], global_denominator=1.0)
            return loss, mb["response_mask"].sum(), {}

        metrics = e.train_mini_batch(batch, loss_fn)
        after = gates()
        out[f"train_{recompute}"] = {
            "grad_norm": float(metrics["actor/grad_norm"]),
            "router_moved_max": max(float((after[k] - before[k]).abs().max()) for k in before),
            "params_on": str(next(iter(e.bare_chunks()[0].parameters())).device),
        }
    g0, g1 = out["train_none"]["grad_norm"], out["train_full"]["grad_norm"]
    out["recompute_grad_norm_rel_diff"] = abs(g0 - g1) / max(abs(g0), 1e-12)
    return out


if __name__ == "__main__":
    main()
