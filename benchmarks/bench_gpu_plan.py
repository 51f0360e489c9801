"""The planner against a real GPU: predicted vs measured training memory and step time, per recompute.

    python3 benchmarks/bench_gpu_plan.py --out DIR [--kinds moe,dense] [--recompute none,selective,full]

For the rare GPU machine (one H100; megatron-core, mbridge, transformers carried as wheels). One
process, NCCL, world size 1, bf16 engine (`actor.precision=bf16`), one packed micro-batch of
`--rows` x `--seq` tokens per training step (prompt 16 tokens, the loss on the rest): the shapes of
bench_gpu.py (a Qwen3-MoE of 1.49B parameters, hidden 2048, 32 experts top-8; a dense Qwen3 of
Qwen3-0.6B's shape).

Measured, per (model, recompute): the peak of torch.cuda.max_memory_allocated over two training
steps after a warm-up one (the optimizer state exists by then), the same for memory reserved by the
caching allocator, and the median step time. Predicted: megarl.perf.memory.train_memory for the
same layout (parameters, fp32 gradient buffer, Adam state + fp32 master, activations, logits;
its runtime reserve is reported apart, since torch's counters do not see the CUDA context) and
megarl.perf.steptime.update_time with the GPU efficiencies, for a config made from
configs/quickstart.yaml with this model and shape. Each (model, recompute) is guarded: a failure
records its traceback and the rest go on. Results: DIR/bench_gpu_plan.json and a markdown table.

--smoke: tiny widths, 2 x 64 tokens, one timed step on the CPU (gloo), to check the script itself;
its predictions are the CPU device's. The exit status is 1 when a (model, recompute) failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import DENSE, DEVICE, MOE, SMOKE, SMOKE_RUN, _init_dist, _pg_loss, _sync  # noqa: E402

PROMPT = 16
GIB = 2**30


def _model(kind: str, tmp: str, smoke: bool) -> tuple[str, dict]:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config_cls, model_cls, shape = (
        (Qwen3MoeConfig, Qwen3MoeForCausalLM, MOE) if kind == "moe" else (Qwen3Config, Qwen3ForCausalLM, DENSE)
    )
    cfg = config_cls(**{**shape, **({k: v for k, v in SMOKE.items() if k in shape} if smoke else {})})
    torch.manual_seed(0)
    model = model_cls(cfg).to(torch.bfloat16)
    path = os.path.join(tmp, kind)
    model.save_pretrained(path)
    del model
    with open(os.path.join(path, "config.json")) as f:
        return path, json.load(f)


def _predicted(hf: dict, path: str, recompute: str, rows: int, seq: int) -> dict:
    from megarl.config.loader import load_config
    from megarl.perf.hardware import cpu_device, parse_devices
    from megarl.perf.memory import train_memory
    from megarl.perf.steptime import CPU_EFFICIENCY, GPU_EFFICIENCY, update_time

    cfg = load_config(
        os.path.join(ROOT, "configs/quickstart.yaml"),
        [
            f"model.path={path}",
            "actor.precision=bf16",
            f"actor.recompute={recompute}",
            f"data.train_batch_size={rows}",
            "rollout.n=1",
            f"actor.ppo_mini_batch_size={rows}",
            f"actor.micro_batch_size={rows}",
            f"data.max_prompt_length={PROMPT}",
            f"rollout.max_new_tokens={seq - PROMPT}",
            "cluster.num_actor_ranks=1",
            "actor.parallel.ep=1",
            "actor.parallel.tp=1",
            "actor.parallel.pp=1",
            "actor.ppo_epochs=1",
            "ref.enabled=false",
        ],
    )
    if DEVICE == "cuda":
        _, device = parse_devices("1xH100")
        eff = GPU_EFFICIENCY
    else:
        device, eff = cpu_device(1), CPU_EFFICIENCY
    mem = train_memory(cfg, hf, device)
    seconds, flops, _ = update_time(cfg, hf, device, mem, float(seq - PROMPT), eff, 1, 1)
    items = dict(
        params=mem.params, grads=mem.grads, optimizer=mem.optimizer, activations=mem.activations, logits=mem.logits
    )
    return dict(
        **{f"{k}_gib": round(v / GIB, 2) for k, v in items.items()},
        model_gib=round(sum(items.values()) / GIB, 2),
        reserve_gib=round(mem.reserve / GIB, 2),
        update_s=round(seconds, 4),
        train_flops=flops,
    )


def measure(kind: str, path: str, hf: dict, recompute: str, args) -> dict:
    from megarl.data.batch import Batch

    rows, seq = args.rows if kind == "moe" else args.dense_rows, args.seq if kind == "moe" else args.dense_seq
    pred = _predicted(hf, path, recompute, rows, seq)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf["vocab_size"], (rows, seq), generator=g)
    adv = torch.randn(rows, 1, generator=g).expand(rows, seq - PROMPT).contiguous()
    batch = Batch(
        {
            "input_ids": ids,
            "responses": ids[:, PROMPT:],
            "response_mask": torch.ones(rows, seq - PROMPT),
            "prompt_lengths": torch.full((rows,), PROMPT),
            "advantages": adv,
        }
    )
    engine = _recompute_engine(path, recompute, rows)
    engine.train_mini_batch(batch, _pg_loss)  # warm-up: optimizer state, allocator pools
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, norms = [], []
    for _ in range(args.steps):
        _sync()
        t = time.perf_counter()
        norms.append(engine.train_mini_batch(batch, _pg_loss)["actor/grad_norm"])
        _sync()
        times.append(time.perf_counter() - t)
    out = dict(
        rows=rows,
        seq=seq,
        tokens=rows * seq,
        step_s=sorted(times)[len(times) // 2],
        all_step_s=[round(x, 4) for x in times],
        grad_norm=norms[-1],
    )
    if DEVICE == "cuda":
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
        out["memory_error"] = round(pred["model_gib"] / out["peak_allocated_gib"] - 1, 3)
    out["mfu"] = round(pred["train_flops"] / out["step_s"] / 989e12, 4) if DEVICE == "cuda" else None
    out["time_error"] = round(pred["update_s"] / out["step_s"] - 1, 3)
    del engine
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return dict(predicted=pred, **out)


def _recompute_engine(path: str, recompute: str, rows: int):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    engine = MegatronEngine(
        EngineSpec(
            model_path=path,
            parallel=ParallelConfig(sequence_parallel=False),
            precision="bf16",
            optim=OptimConfig(lr=1e-6, adam_eps=1e-2, clip_grad=0.0),
            micro_batch_size=rows,
            seed=1,
            recompute=recompute,
        )
    )
    engine.initialize()
    return engine


def table(results: dict) -> str:
    lines = [
        "| model | recompute | tokens | measured peak allocated GiB (reserved) | predicted GiB (params / grads / optim / acts / logits) | error | step s measured | predicted | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        if key == "env":
            continue
        if not r.get("ok"):
            lines.append(f"| {key} | failed: {r.get('error', '')[-200:]!r} |")
            continue
        p = r["predicted"]
        lines.append(
            f"| {key.split('/')[0]} | {key.split('/')[1]} | {r['tokens']} | {r.get('peak_allocated_gib')} "
            f"({r.get('peak_reserved_gib')}) | {p['model_gib']} ({p['params_gib']} / {p['grads_gib']} / "
            f"{p['optimizer_gib']} / {p['activations_gib']} / {p['logits_gib']}) | {r.get('memory_error')} | "
            f"{r['step_s']:.3f} | {p['update_s']:.3f} ({r['time_error']:+.0%}) | {r['mfu']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="where bench_gpu_plan.json goes (default: .; --smoke: a temp dir)")
    ap.add_argument("--kinds", default="moe,dense")
    ap.add_argument("--recompute", default="none,selective,full")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dense-rows", type=int, default=4)
    ap.add_argument("--dense-seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.out = args.out or (tempfile.mkdtemp(prefix="bench_gpu_plan_smoke_") if args.smoke else ".")
    if args.smoke:  # smoke sizes replace the defaults only: flags given explicitly still win
        for key, value in SMOKE_RUN.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    os.makedirs(args.out, exist_ok=True)
    _init_dist()
    results: dict = {}
    if DEVICE == "cuda":
        results["env"] = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds.split(","):
            try:
                path, hf = _model(kind, tmp, args.smoke)
            except Exception:
                results[kind] = {"ok": False, "error": traceback.format_exc()[-3000:]}
                continue
            for rc in args.recompute.split(","):
                t = time.perf_counter()
                try:
                    results[f"{kind}/{rc}"] = {"ok": True, **measure(kind, path, hf, rc, args)}
                except Exception:
                    results[f"{kind}/{rc}"] = {"ok": False, "error": traceback.format_exc()[-3000:]}
                results[f"{kind}/{rc}"]["wall_s"] = round(time.perf_counter() - t, 1)
                print(kind, rc, json.dumps(results[f"{kind}/{rc}"]), flush=True)
                with open(os.path.join(args.out, "bench_gpu_plan.json"), "w") as f:
                    json.dump(results, f, indent=1)
    print(table(results), flush=True)
    failed = [key for key, r in results.items() if key != "env" and not r.get("ok")]
    if failed:
        sys.exit(f"bench_gpu_plan: failed: {', '.join(failed)} (tracebacks above and in bench_gpu_plan.json)")


if __name__ == "__main__":
    main()
