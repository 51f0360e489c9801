"""The planner against what was measured: published RL runs, and two quickstart layouts on this host.

    .venv/bin/python benchmarks/bench_plan.py [--calibration] [--cpu] [--steps 12] [--repeats 3]

--calibration: `megarl plan`'s prediction for published runs, expressed as overrides of our scale
configs, next to the published numbers (sources: verl docs/perf/dpsk.md and its example scripts at
volcengine/verl b178a3cd; NeMo-RL docs/about/performance-summary.md at v0.6.0). Their rollout
engine is vLLM (planned here as SGLang with the same memory fraction); their GPUs are H20 (verl)
and H100 (NeMo-RL); verl's MFU is the actor update's (flops * epochs / (peak * GPUs * update
time)); NeMo-RL's tokens/s/GPU are prompt + generated tokens / step time / GPUs.

--cpu: runs the quickstart for --steps steps in two layouts (tp1/pp1/ep2, and pp2), --repeats times
interleaved, and compares the medians of its logged phase times (steps 3..N; then the median over
runs, with the range) and the ranks' measured memory
(perf/memory/*: parameters, gradients and optimizer state in bytes, peak RSS) with the plan's.
The CPU constants in megarl/perf/steptime.py were set from earlier runs of the first layout; the
second layout is the out-of-sample check.
Prints markdown for benchmarks/RESULTS.md.

--smoke: the calibration, and --cpu for the out-of-sample layout only: one run of 3 steps (the
first 2 are left out, as always), to check the script and the planner against a real run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name, base config, overrides, devices, mean prompt, mean response, published {metric: value}
CALIBRATION = [
    (
        "verl DeepSeek-V3 671B, 96 x H20 (dpsk.md; run_deepseek671b_math_megatron_96gb.sh)",
        "deepseek-v3-671b",
        [
            "cluster.num_actor_ranks=96",
            "actor.parallel.tp=8",
            "actor.parallel.pp=12",
            "actor.parallel.ep=8",
            "actor.parallel.first_stage_layers=null",
            "actor.parallel.last_stage_layers=6",
            "actor.recompute=full",
            "data.train_batch_size=96",
            "rollout.n=8",
            "actor.ppo_mini_batch_size=256",
            "data.max_prompt_length=2048",
            "rollout.max_new_tokens=9632",
            "actor.max_tokens_per_micro_batch=11680",
            "actor.use_kl_loss=true",
            "rollout.num_servers=3",
            "rollout.tp=32",
            "rollout.nnodes=4",
            "rollout.ep=1",
            "rollout.dp=1",
            "rollout.mem_fraction_static=0.6",
        ],
        "96xH20",
        None,
        1960,
        {
            "update MFU": 0.19,
            "step s": 1700,
            "generation s": 1050,
            "memory GiB": 66 / 1.074,
            "memory GiB (no optimizer on GPU)": 66 / 1.074,
        },
    ),
    (
        "NeMo-RL DeepSeek-V3, 256 x H100 (performance-summary.md v0.6.0; grpo-deepseek-v3-32n8g.yaml)",
        "deepseek-v3-671b",
        [
            "actor.parallel.tp=1",
            "actor.parallel.sequence_parallel=false",
            "actor.parallel.pp=16",
            "actor.parallel.ep=16",
            "actor.recompute=full",
            "data.train_batch_size=32",
            "rollout.n=16",
            "actor.ppo_mini_batch_size=512",
            "data.max_prompt_length=512",
            "rollout.max_new_tokens=1024",
            "actor.max_tokens_per_micro_batch=1536",
            "actor.use_kl_loss=true",
            "rollout.num_servers=8",
            "rollout.tp=32",
            "rollout.nnodes=4",
            "rollout.ep=1",
            "rollout.dp=1",
            "rollout.mem_fraction_static=0.6",
        ],
        "256xH100",
        110,
        701,
        {"tokens/s/GPU": 12.1, "step s": 134},
    ),
    (
        "verl Qwen3-30B-A3B, 8 x H20 (dpsk.md; run_qwen3moe-30b_megatron_96gb.sh)",
        "qwen3-30b-a3b",
        [
            "actor.parallel.tp=1",
            "actor.parallel.ep=8",
            "data.train_batch_size=512",
            "rollout.n=16",
            "actor.ppo_mini_batch_size=2048",
            "data.max_prompt_length=2048",
            "rollout.max_new_tokens=8192",
            "actor.max_tokens_per_micro_batch=10240",
            "rollout.num_servers=2",
            "rollout.tp=4",
            "rollout.mem_fraction_static=0.7",
            "actor.recompute=none",
        ],
        "8xH20",
        None,
        4096,
        {"update MFU": 0.40},
    ),
    (
        "NeMo-RL Qwen3-30B-A3B, 32 x H100 (performance-summary.md v0.6.0; grpo-qwen3-30ba3b-4n8g.yaml)",
        "qwen3-30b-a3b",
        [
            "cluster.num_actor_ranks=32",
            "actor.parallel.tp=1",
            "actor.parallel.ep=8",
            "data.train_batch_size=64",
            "rollout.n=32",
            "actor.ppo_mini_batch_size=512",
            "data.max_prompt_length=512",
            "rollout.max_new_tokens=3584",
            "actor.max_tokens_per_micro_batch=4096",
            "rollout.num_servers=16",
            "rollout.tp=2",
            "rollout.mem_fraction_static=0.6",
            "actor.recompute=none",
            "data.num_train=65536",
        ],
        "32xH100",
        110,
        3203,
        {"tokens/s/GPU": 1102, "step s": 192},
    ),
    # weight sync alone, trainer pool -> rollout pool over the network (verl docs/advance/fully_async.md,
    # H20, Megatron), with verl's bucketed checkpoint engine (2 GiB buckets) as megarl buckets too;
    # each transport against every published sync: bench_sync_plan.py
    (
        "verl Qwen3-30B-A3B weight sync, 16 -> 16 H20 (fully_async.md, checkpoint engine)",
        "qwen3-30b-a3b",
        [
            "cluster.placement=disaggregated",
            "cluster.num_rollout_devices=16",
            "bridge.transport=distributed",
            "bridge.bucket_size_mb=2048",
            "rollout.release_memory=null",
        ],
        "32xH20",
        None,
        1024,
        {"weight sync s": 4.38},
    ),
    (
        "verl Qwen3-235B-A22B weight sync, 64 -> 64 H20 (fully_async.md, checkpoint engine)",
        "qwen3-235b-a22b",
        [
            "cluster.num_actor_ranks=64",
            "actor.parallel.pp=2",
            "actor.parallel.first_stage_layers=null",
            "actor.parallel.last_stage_layers=null",
            "cluster.placement=disaggregated",
            "cluster.num_rollout_devices=64",
            "rollout.num_servers=8",
            "rollout.tp=8",
            "bridge.transport=distributed",
            "bridge.bucket_size_mb=2048",
            "rollout.release_memory=null",
            "actor.ppo_mini_batch_size=64",
        ],
        "128xH20",
        None,
        1024,
        {"weight sync s": 23.70},
    ),
]


def calibration() -> None:
    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.perf.hardware import GiB, parse_devices
    from megarl.perf.plan import make_plan, update_mfu

    print("| published run | metric | published | predicted | error |")
    print("|---|---|---:|---:|---:|")
    for name, base, overrides, devices, prompt, response, published in CALIBRATION:
        cfg = validate(load_config(str(ROOT / "configs" / f"{base}.yaml"), overrides))
        hf = json.loads((ROOT / cfg.model.path / "config.json").read_text())
        count, device = parse_devices(devices)
        plan = make_plan(cfg, hf, device, mean_response=response, mean_prompt=prompt)
        t = plan.time
        rows = cfg.data.train_batch_size * cfg.rollout.n
        mean_prompt = prompt if prompt is not None else cfg.data.max_prompt_length
        predicted = {
            "update MFU": update_mfu(cfg, plan),
            "step s": t.total,
            "generation s": t.generation,
            "weight sync s": t.weight_sync,
            "tokens/s/GPU": rows * (mean_prompt + response) / t.total / count,
            "memory GiB": plan.peak("train") / GiB,
            # verl runs Adam on the host (optimizer offload fraction 1.0): no optimizer state on
            # the GPU while training; megarl has no CPU optimizer, so this is the comparable figure
            "memory GiB (no optimizer on GPU)": (plan.peak("train") - plan.train.optimizer) / GiB,
        }
        for metric, value in published.items():
            p = predicted[metric]
            print(f"| {name} | {metric} | {value:.3g} | {p:.3g} | {(p - value) / value:+.0%} |")
        print(
            f"| | (phases, s) | | gen {t.generation:.0f}, log-prob {t.log_prob:.0f}, update {t.update:.0f}, "
            f"sync {t.weight_sync:.0f}; train peak {plan.peak('train') / GiB:.0f} GiB"
            f"{'' if plan.fits else ' (does not fit)'} | |"
        )


def _run_quickstart(out: Path, steps: int, overrides: list[str]) -> list[dict]:
    """The quickstart's metrics rows; its output goes to a log whose tail a failure quotes."""
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "train",
        str(ROOT / "configs" / "quickstart.yaml"),
        f"trainer.total_steps={steps}",
        "trainer.val_every=0",
        "trainer.export_hf=false",
        f"trainer.output_dir={out}",
        "trainer.loggers=[console,jsonl]",
        *overrides,
    ]
    log = out / "train.log"
    with open(log, "w") as f:
        done = subprocess.run(
            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"bench_plan: the quickstart run exited {done.returncode}; its log's last lines:\n{tail}")
    return [json.loads(line) for line in (out / "quickstart" / "metrics.jsonl").read_text().splitlines()]


LAYOUTS = {
    "tp1 pp1 ep2 (default; its earlier runs set the CPU constants)": [],
    "pp2 ep1 (out of sample)": ["actor.parallel.pp=2", "actor.parallel.ep=1"],
}


def cpu(steps: int, repeats: int, layouts: dict, extra: list[str]) -> None:
    from megarl.cli import _model_config
    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.perf.hardware import MiB, cpu_device
    from megarl.perf.plan import make_plan

    times = {
        "generation s": ["perf/gen_s"],
        "log-probs s": ["perf/old_log_prob_s", "perf/ref_s"],
        "update s": ["perf/update_s"],
        "weight sync s (+ release/resume)": ["perf/sync_s", "perf/release_s", "perf/resume_s", "perf/resume_kv_s"],
        "step s": ["perf/step_s"],
        "params MiB (largest rank)": ["perf/memory/actor_params_gib"],
        "grads MiB": ["perf/memory/actor_grads_gib"],
        "optimizer MiB": ["perf/memory/actor_optimizer_gib"],
        "rank peak RSS MiB vs the plan's trainer peak": ["perf/memory/actor_peak_gib"],
    }
    runs: dict[str, list[dict]] = {name: [] for name in layouts}
    for _ in range(repeats):  # layouts interleaved, so machine noise hits both alike
        for name, overrides in layouts.items():
            with tempfile.TemporaryDirectory() as tmp:
                rows = _run_quickstart(Path(tmp), steps, overrides + extra)[2:]
            runs[name].append(
                {
                    q: statistics.median(sum(r.get(k, 0.0) for k in keys) for r in rows) * (1024 if "MiB" in q else 1)
                    for q, keys in times.items()
                }
            )
    print(f"| layout | quantity | measured (median of {repeats} runs; range) | predicted | error |")
    print("|---|---|---:|---:|---:|")
    for name, overrides in layouts.items():
        cfg = validate(load_config(str(ROOT / "configs" / "quickstart.yaml"), overrides))
        plan = make_plan(cfg, _model_config(cfg), cpu_device(2))
        t = plan.time
        predicted = {
            "generation s": t.generation,
            "log-probs s": t.log_prob,
            "update s": t.update,
            "weight sync s (+ release/resume)": t.weight_sync,
            "step s": t.total,
            "params MiB (largest rank)": plan.train.params / MiB,
            "grads MiB": plan.train.grads / MiB,
            "optimizer MiB": plan.train.optimizer / MiB,
            "rank peak RSS MiB vs the plan's trainer peak": plan.train.peak / MiB,
        }
        for q in times:
            values = [run[q] for run in runs[name]]
            m, p = statistics.median(values), predicted[q]
            # a phase the loop did not run (e.g. old log-probs under actor.old_log_prob=rollout) logs nothing
            error = f"{(p - m) / m:+.0%}" if m else "not run"
            print(f"| {name} | {q} | {m:.3g} ({min(values):.3g}-{max(values):.3g}) | {p:.3g} | {error} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="--cpu: model.path of the runs (default: the quickstart's, built)")
    ap.add_argument("--smoke", action="store_true", help="calibration + one 3-step run (checks the script)")
    args = ap.parse_args(argv)
    layouts = LAYOUTS
    if args.smoke:  # smoke sizes replace the defaults only: flags given explicitly still win
        args.steps = 3 if args.steps == ap.get_default("steps") else args.steps
        args.repeats = 1 if args.repeats == ap.get_default("repeats") else args.repeats
        layouts = {k: v for k, v in LAYOUTS.items() if "out of sample" in k}
    if args.steps < 3:
        ap.error("--steps must be >= 3 (the first 2 steps are left out)")
    if args.calibration or not args.cpu:
        calibration()
    if args.cpu or not args.calibration:
        print()
        cpu(args.steps, args.repeats, layouts, [f"model.path={args.model}"] if args.model else [])


if __name__ == "__main__":
    main()
