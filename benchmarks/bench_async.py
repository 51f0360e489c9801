"""The loop modes against each other: trainer.mode sync vs one_step_off vs fully_async, same task,
model and processes, in one run.

    .venv/bin/python benchmarks/bench_async.py [--steps 12] [--max-new-tokens 48] [--eos-bias 1.75]

Workload: configs/disaggregated.yaml (the digits task, tiny Qwen3-MoE) with one actor rank
(num_actor_ranks=1) and one tp=1 engine: two compute processes, each with one torch thread, on a
2-core machine. In the sync loop one of them always waits for the other (the engine while the
actor trains, the actor while the engine generates), so a core idles; the async loops give both
work at once. That is how generation and training genuinely overlap on 2 cores: the same two
processes, either alternating or running side by side.

Long tail: every sample has up to --max-new-tokens tokens and a logit bias of --eos-bias on the
end-of-sequence token (SGLang's `logit_bias` sampling parameter), so lengths are roughly
geometric: most responses end within a few tokens, a few run to the limit. The sync loop's
step waits for the longest; the reward reads only the first character, so the task is unchanged.
The engines report log-probs of the biased logits (as SGLang does), so the parity check is off
here: every mode trains on the same slightly off-policy samples.

CPU: the CPU seconds per steady step of every process of the run (this script is the driver;
Ray's processes, the ranks and the engine are its descendants; profile_step.py's accounting), and
that total over the 2 cores: no mode's step can be shorter than that bound.

Each mode gets its own runtime (Ray cluster, engine, actor; start-up not timed) and --steps
steps; time is wall-clock from the first step's start to the last step's end. Reported per mode:
samples/s (rows trained / time) and steady samples/s (steps 3..N only: the first steps carry
every process's first-call costs, the same in each mode), each with its ratio to the sync loop's;
reward mean over the first and last --window steps, reward gained per minute ((last window -
first window) / time); response tokens trained per second and its ratio to the sync loop's (a
mode that trains the short answers first, or drops late long ones, gains samples/s, not tokens/s);
the machine's 1-minute load average as the mode starts.

--smoke: fully_async only (the loop with the most moving parts; --modes still chooses), 3 steps
of up to 8 new tokens, a window of 1: checks the script and the loop end to end in one runtime.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from megarl.rollout.client.manager import SamplingSpec

ROOT = Path(__file__).resolve().parents[1]
SMOKE = dict(steps=3, max_new_tokens=8, window=1, modes="fully_async")  # --smoke: replaces these defaults


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--eos-bias", type=float, default=1.75)
    p.add_argument("--window", type=int, default=4)
    p.add_argument(
        "--modes",
        default="sync,one_step_off,fully_async",
        help="comma-separated; fully_async@K runs fully_async with trainer.max_staleness=K",
    )
    p.add_argument("--pause-mode", default="retract", help="fully_async's trainer.pause_mode")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the modes this many times, interleaved (sync, one_step_off, fully_async, "
        "sync, ...); each ratio is against the sync run of its own round and the table "
        "shows medians, so a machine whose speed drifts over minutes compares like with like",
    )
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--model", default=None, help="HF checkpoint (default: the config's tiny preset, built per run)")
    p.add_argument("--smoke", action="store_true", help="fully_async, 3 short steps (checks the script)")
    args = p.parse_args(argv)
    if args.smoke:  # smoke sizes replace the defaults only: flags given explicitly still win
        for key, value in SMOKE.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    if args.steps < 3:
        p.error("--steps must be >= 3 (the steady rate is over steps 3..N)")
    return args


class _TimedLogger:
    """The trainer's logger, plus the wall-clock time each step was logged and the CPU seconds of
    every process of the run when step 2 and the last step were logged (the steady window)."""

    def __init__(self, inner, steps: int):
        self.inner, self.times, self.rows, self.steps, self.cpu = inner, [], [], steps, []

    def log(self, step, metrics):
        self.times.append(time.perf_counter())
        self.rows.append(dict(metrics))
        if len(self.times) in (2, self.steps):
            self.cpu.append(_cpu_per_process())
        self.inner.log(step, metrics)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _cpu_per_process() -> dict[int, tuple[str, float]]:
    """pid -> (kind, CPU seconds so far) of this process (the driver) and every descendant (Ray's
    processes, the Megatron ranks, the engines): profile_step.py's accounting."""
    from profile_step import _children, _cmdline, _cpu_seconds, kind_of

    me, out = os.getpid(), {}
    for pid in [me, *_children(me)]:
        seconds = _cpu_seconds(pid)
        if seconds is not None:
            out[pid] = (kind_of(_cmdline(pid), pid == me), seconds)
    return out


def _cpu_per_step(before: dict, after: dict, steps: int) -> dict[str, float]:
    """CPU seconds per step of each kind of process between two snapshots, and "all"."""
    per_kind: dict[str, float] = collections.Counter()
    for pid, (kind, seconds) in after.items():
        per_kind[kind] += (seconds - before.get(pid, (kind, 0.0))[1]) / steps
    return {**per_kind, "all": sum(per_kind.values())}


def run_mode(label: str, args, workdir: Path) -> dict:
    import io

    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.trainer.loop import Trainer
    from megarl.trainer.metrics import MetricsLogger
    from megarl.trainer.runtime import start_runtime

    mode, _, staleness = label.partition("@")
    load = os.getloadavg()[0]  # the machine's 1-minute load as this mode starts (before its own processes)
    cfg = validate(
        load_config(
            ROOT / "configs/disaggregated.yaml",
            [
                f"trainer.output_dir={workdir / label}",
                f"trainer.total_steps={args.steps}",
                "trainer.val_every=0",
                "trainer.loggers=[console,jsonl]",
                "trainer.export_hf=false",
                f"trainer.mode={mode}",
                "cluster.num_actor_ranks=1",
                "actor.parallel.ep=1",
                "rollout.tp=1",
                f"rollout.max_new_tokens={args.max_new_tokens}",
                "rollout.max_batch_size=256",
                "actor.ppo_mini_batch_size=128",
                "actor.micro_batch_size=64",
                "bridge.check_parity=false",
                f"trainer.pause_mode={args.pause_mode}",
                f"trainer.max_staleness={staleness or args.max_staleness}",
                *([f"model.path={args.model}"] if args.model else []),
            ],
        )
    )  # the engines' log-probs are of the biased logits (as SGLang's)
    with start_runtime(cfg) as rt:
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(rt.model_path).eos_token_id
        logger = _TimedLogger(MetricsLogger(None, args.steps, stream=io.StringIO()), args.steps)
        trainer = Trainer(rt, logger)
        plain = trainer.sampling

        def biased(step, train, round_=0):  # the long tail: a bias towards ending
            spec = plain(step, train, round_)
            return _Biased(**dataclasses.asdict(spec), eos=eos, bias=args.eos_bias) if train else spec

        trainer.sampling = biased
        start = time.perf_counter()
        trainer.fit()
        engine_stats = []  # forward steps, joins, batches of each engine over the run
        for url in rt.fleet.engine_urls:
            with rt.fleet.client(url) as client:
                engine_stats.append(client.get_server_info().get("engine_stats"))
    rewards = [m["reward/mean"] for m in logger.rows]
    lengths = [m["response/length_mean"] for m in logger.rows]
    elapsed = logger.times[-1] - start
    rows = cfg.data.train_batch_size * cfg.rollout.n * args.steps
    w = args.window
    steady = (logger.times[-1] - logger.times[1]) / (args.steps - 2)  # steps 3..N: no first-call costs
    return {
        "mode": label,
        "steps": args.steps,
        "wall_s": elapsed,
        "samples_per_s": rows / elapsed,
        "steady_s_per_step": steady,
        "steady_samples_per_s": cfg.data.train_batch_size * cfg.rollout.n / steady,
        "reward_first": float(np.mean(rewards[:w])),
        "reward_last": float(np.mean(rewards[-w:])),
        "reward_gain_per_min": (np.mean(rewards[-w:]) - np.mean(rewards[:w])) / (elapsed / 60),
        "length_mean": float(np.mean(lengths)),
        "tokens_per_s": cfg.data.train_batch_size * cfg.rollout.n * float(np.sum(lengths)) / elapsed,
        "load_before": load,
        "max_length_frac": float(np.mean([m["response/clip_ratio"] for m in logger.rows])),
        "staleness_mean": float(np.mean([m.get("async/staleness_mean", 0.0) for m in logger.rows])),
        "partial_frac": float(np.mean([m.get("async/partial_frac", 0.0) for m in logger.rows])),
        "engine_stats": engine_stats,
        "cpu_s_per_step": _cpu_per_step(*logger.cpu, args.steps - 2),
        "per_step": [
            {k: v for k, v in m.items() if k.startswith(("perf/", "async/", "reward/mean"))} for m in logger.rows
        ],
    }


def _median_run(runs: list[dict]) -> dict:
    """One mode over the rounds: the median of each number (the per-step detail of every round)."""
    if len(runs) == 1:
        return {**runs[0], "ratios": [runs[0]["ratio_vs_sync"] or float("nan")]}
    out = {"mode": runs[0]["mode"], "rounds": runs, "ratios": [r["ratio_vs_sync"] or float("nan") for r in runs]}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(np.median([r[key] for r in runs]))
    kinds = {k for r in runs for k in r["cpu_s_per_step"]}
    out["cpu_s_per_step"] = {k: float(np.median([r["cpu_s_per_step"].get(k, 0.0) for r in runs])) for k in kinds}
    return {"ratio_vs_sync": None, "steady_ratio_vs_sync": None, "tokens_ratio_vs_sync": None, **out}


@dataclasses.dataclass
class _Biased(SamplingSpec):
    """The trainer's sampling plus a logit bias towards ending (the long tail)."""

    eos: int = 0
    bias: float = 0.0

    def to_sglang(self) -> dict:
        return {**super().to_sglang(), "logit_bias": {str(self.eos): self.bias}}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            rounds.append([run_mode(mode, args, Path(tmp) / f"round{k}") for mode in args.modes.split(",")])
    for runs in rounds:  # ratios within a round
        base = {r["mode"]: r for r in runs}.get("sync")
        for r in runs:
            r["ratio_vs_sync"] = r["samples_per_s"] / base["samples_per_s"] if base else None
            r["steady_ratio_vs_sync"] = r["steady_samples_per_s"] / base["steady_samples_per_s"] if base else None
            r["tokens_ratio_vs_sync"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
    results = [_median_run([runs[i] for runs in rounds]) for i in range(len(rounds[0]))]
    if args.repeats > 1:
        print(
            f"medians over {args.repeats} interleaved rounds; ratios within each round: "
            + "; ".join(f"{r['mode']} {', '.join(f'{x:.2f}' for x in r['ratios'])}" for r in results)
        )
    print(
        f"{'mode':<15} {'wall s':>7} {'samples/s':>9} {'x sync':>6} {'steady/s':>8} {'x sync':>6} "
        f"{'reward first':>12} {'last':>6} {'gain/min':>8} {'len':>5} {'at max':>6} {'stale':>5} {'partial':>7} "
        f"{'CPU s/step: ranks':>17} {'engine':>6} {'driver':>6} {'all':>5} {'/2 cores':>8} {'s/step':>6} "
        f"{'tokens/s':>8} {'x sync':>6} {'load':>5}"
    )
    for r in results:
        cpu = r["cpu_s_per_step"]
        print(
            f"{r['mode']:<15} {r['wall_s']:7.1f} {r['samples_per_s']:9.1f} "
            f"{r['ratio_vs_sync'] or float('nan'):6.2f} {r['steady_samples_per_s']:8.1f} "
            f"{r['steady_ratio_vs_sync'] or float('nan'):6.2f} {r['reward_first']:12.3f} {r['reward_last']:6.3f} "
            f"{r['reward_gain_per_min']:8.3f} {r['length_mean']:5.1f} {r['max_length_frac']:6.1%} "
            f"{r['staleness_mean']:5.2f} {r['partial_frac']:7.1%} {cpu.get('megatron rank', 0):17.3f} "
            f"{cpu.get('rollout engine', 0) + cpu.get('rollout engine TP rank', 0):6.3f} {cpu.get('driver', 0):6.3f} "
            f"{cpu['all']:5.3f} {cpu['all'] / 2:8.3f} {r['steady_s_per_step']:6.3f} "
            f"{r['tokens_per_s']:8.0f} {r.get('tokens_ratio_vs_sync') or float('nan'):6.2f} {r['load_before']:5.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
