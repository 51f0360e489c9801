"""megarl's CPU quickstart against Hugging Face TRL 1.16's GRPOTrainer: same model, task, batch, lr
and loss, run in alternating pairs, each run a fresh process; reports time ratios megarl / TRL.

    bash benchmarks/setup_trl_env.sh      # once: .venv-trl (torch 2.13.0, then trl 1.16.0); also
                                          # run by this script when --trl-python is not given
    .venv/bin/python benchmarks/bench_vs_trl.py [--variants quickstart,compute] [--pairs 3]
        [--steps N] [--json out.json] [--trl-python PATH] [--megarl-arg key=value ...] [--model DIR]

TRL is a benchmark-only dependency: it lives in .venv-trl (transformers 5.x there, 4.57 in .venv),
never in requirements.lock, and the test suite does not need it. Its side is benchmarks/_trl_grpo.py,
whose docstring maps every quickstart setting to TRL's (token-mean = loss_type "dapo", ...).

Variants:

- quickstart: configs/quickstart.yaml as shipped, 200 steps: the tiny Qwen3-MoE (hidden 64) learns
  the digits task, 16 prompts x 16 samples, 2 new tokens, 2 optimizer steps of 128 rows a step.
- compute: the same model 6x wider (hidden 384, 6 heads of 64, experts of 384: 4.4M parameters,
  2.6M active per token) and every response exactly 64 tokens, 8 steps (the first 2 warm-up):
  GEMMs dominate (sized for a TRL step of roughly 5-15 s on 2 cores). megarl runs one rollout
  engine per device (rollout.num_servers=2, batched requests straight to each: rollout.router=false),
  as verl sizes its rollout, so both cores generate, and its two ranks are plain data parallel
  (actor.parallel.ep=1; the quickstart's EP=2 measured 0.95x here, RESULTS.md says why). Exact lengths on both
  sides: the checkpoint's eos is id 64, outside the 64-logit vocabulary, so no side can sample it
  (the tokenizer gets 13 unused ids and <no_eos>; transformers warns that eos is out of vocab).
  Learning is not the point here, equal work is: same rows, tokens and optimizer steps.

Both sides start from the same Hugging Face folder, built here by megarl.models.tiny with model.seed
0 (for the quickstart byte-identical to the init_model megarl builds itself; megarl gets it as
model.path), and train on the same 1024 digits prompts (megarl generates them itself from data.seed
0; TRL reads make_digits_rows(1024, seed=0)), in different orders. megarl runs with validation off
(trainer.val_every=0, as TRL does no eval); everything else is the quickstart's, including the
per-step log-prob parity check, tensorboard and the final HF export. With validation off megarl's
curve equals the checked-in reference only up to step 50: the reference validated at step 50, and
greedy validation still draws from the engine's sampling generator. The script checks steps 1..50.

Pairs alternate which side goes first (megarl first in pair 1, TRL first in pair 2, ...); one
process runs at a time. Per run: whole (launch to exit), steps (first step's start to last step's
end), s/step (median over the steps after the variant's warm-up), start-up (launch to first step's
start), the first step whose 10-step mean reward is >= 0.9 and the steps-clock time to its end,
and the 1-minute load average before/after. Then the medians per side and megarl/TRL ratios, and
where a step went on each side: generation, the batch's preparation (TRL's old log-prob pass,
reward, advantages; megarl's reward and advantages, as it takes the rollout's log-probs), the update
(TRL: the round's optimizer steps), and megarl's weight sync and the rest.
megarl's perf/step_s spans generation to the end of the weight sync (Trainer.train_step; not
validation, not logging) and a step's start is its progress line's arrival minus it; TRL's rounds
(generation + 2 optimizer steps) are timed by a TrainerCallback. Logs and per-run files: --workdir.

--smoke: the quickstart variant, one pair of 3 steps, in a temporary --workdir: checks the script
end to end (megarl's run, its stages, the reference curve's first 3 steps, the tables). TRL runs
only if its venv is already there (--trl-python, or .venv-trl); --smoke never builds it, and
without it says so and runs megarl's side alone. Its exit status is 1 when megarl's 3 steps depart
from the reference (a full run only reports a departure: the reference's later steps differ by
~3e-5 on some CPUs, the first 30 on none).

Noise: TRL's one process runs torch's default 2 threads, which slow down many-fold when anything
else runs on the 2 cores (quickstart: 0.29 s/step alone, 3-9 s/step beside two busy processes);
megarl's one-thread ranks suffer less (~0.18 -> ~0.5 s/step). Trust only pairs whose load averages stay low.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _trl_grpo import digits_score as trl_digits_score  # noqa: E402  (stdlib-only at import)

SIDES = ("megarl", "trl")
REWARD_TARGET, REWARD_WINDOW = 0.9, 10
REFERENCE_STEPS = 50  # the reference curve's first validation step (configs/quickstart.yaml val_every)


@dataclass(frozen=True)
class Variant:
    name: str
    steps: int  # default steps per run
    warmup: int  # first steps left out of the median s/step
    max_new_tokens: int
    model_overrides: dict = field(default_factory=dict)  # HF config changes to tiny-qwen3-moe
    no_eos: bool = False  # eos outside the vocabulary: every response is max_new_tokens long
    megarl_args: tuple = ()  # megarl overrides of the variant (before --megarl-arg)


VARIANTS = {
    "quickstart": Variant("quickstart", steps=200, warmup=5, max_new_tokens=2),
    "compute": Variant(
        "compute",
        steps=8,
        warmup=2,
        max_new_tokens=64,
        no_eos=True,
        model_overrides=dict(
            hidden_size=384,
            intermediate_size=768,
            moe_intermediate_size=384,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=64,
        ),
        # one engine per device, as verl sizes its rollout (devices / tp): generation is GEMM-bound
        # here and the ranks are idle while it runs, so the second core generates too; the two
        # ranks are plain data parallel (EP=1: 4.4M parameters fit a device many times over), so
        # a skewed router never leaves one rank's experts idle while the other's work
        megarl_args=("rollout.num_servers=2", "rollout.router=false", "actor.parallel.ep=1"),
    ),
}


# ------------------------------------------------------------------ shared inputs
def build_model(variant: Variant, out: Path) -> Path:
    """The variant's initial HF checkpoint (seed 0), built once; both sides load this folder."""
    from megarl.models.tiny import PRESETS, build_tiny_checkpoint, build_tokenizer

    overrides = dict(variant.model_overrides)
    vocab = PRESETS["tiny-qwen3-moe"]["vocab_size"]
    if variant.no_eos:
        overrides["eos_token_id"] = vocab  # config.json and generation_config.json: unsampleable
    stamp, want = out / "bench_vs_trl.json", {"overrides": overrides, "no_eos": variant.no_eos}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return out
    build_tiny_checkpoint(out, seed=0, preset="tiny-qwen3-moe", **overrides)
    if variant.no_eos:
        tok = build_tokenizer()
        unused = [f"<unused{i}>" for i in range(len(tok), vocab)]  # fill ids up to the vocabulary
        tok.add_special_tokens({"additional_special_tokens": unused + ["<no_eos>"]})
        tok.eos_token = "<no_eos>"
        assert tok.eos_token_id == vocab, tok.eos_token_id
        tok.save_pretrained(out)
    stamp.write_text(json.dumps(want))
    return out


def write_train_rows(path: Path) -> Path:
    """megarl's digits prompts (data.num_train 1024, data.seed 0) as TRL rows: prompt + answer."""
    from megarl.data.tasks import make_digits_rows

    with open(path, "w") as f:
        for row in make_digits_rows(1024, seed=0):
            f.write(json.dumps({"prompt": row["prompt"], "answer": row["reward_model"]["ground_truth"]}) + "\n")
    return path


def check_reward_equal() -> None:
    """_trl_grpo's copy of the digits reward scores as megarl's (tests/benchmarks/test_bench_vs_trl_reward.py
    checks more strings)."""
    from megarl.reward.rule import digits_score

    for text, gold in [("2", "2"), ("27", "2"), ("", "2"), ("x2", "2"), ("38", "382"), ("\n4", "4")]:
        if trl_digits_score(text, gold) != digits_score(text, gold, {}):
            raise SystemExit(f"bench_vs_trl: _trl_grpo.digits_score({text!r}, {gold!r}) differs from megarl's")


def trl_python(arg: str | None, build: bool = True) -> str | None:
    """--trl-python, or .venv-trl built (or checked) by benchmarks/setup_trl_env.sh; with
    build=False (--smoke) .venv-trl only if it is already there, else None (TRL is not run)."""
    if arg:
        if not Path(arg).exists():
            raise SystemExit(
                f"bench_vs_trl: --trl-python {arg} does not exist; build the TRL venv with "
                "`bash benchmarks/setup_trl_env.sh` (it makes .venv-trl)"
            )
        return arg
    if not build:
        existing = ROOT / ".venv-trl" / "bin" / "python"
        return str(existing) if existing.exists() else None
    script = ROOT / "benchmarks" / "setup_trl_env.sh"
    print("bench_vs_trl: checking .venv-trl (bash benchmarks/setup_trl_env.sh; the first time ~2 min)", flush=True)
    if subprocess.run(["bash", str(script)], cwd=ROOT).returncode != 0:
        raise SystemExit(
            "bench_vs_trl: benchmarks/setup_trl_env.sh failed (output above); fix it, or pass "
            "--trl-python PATH to a python with torch 2.13.0 and trl 1.16.0"
        )
    return str(ROOT / ".venv-trl" / "bin" / "python")


# ------------------------------------------------------------------ one run
def load_avg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def run_logged(cmd: list[str], log_path: Path, on_line=None) -> tuple[float, float]:
    """Run `cmd` from the repo root, its output to `log_path`; on_line(text, time) per line.
    Returns (launch time, exit time); a failure raises with the log's tail."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        launch = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            for line in proc.stdout:
                now = time.time()
                log.write(line)
                if on_line:
                    on_line(line, now)
            rc = proc.wait()
        except BaseException:  # Ctrl-C: stop the child (megarl stops its Ray cluster on SIGINT)
            proc.send_signal(2)
            proc.wait()
            raise
        end = time.time()
    if rc != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"bench_vs_trl: {' '.join(cmd[:4])} ... exited {rc}; log {log_path}, last lines:\n{tail}")
    return launch, end


def run_megarl(variant: Variant, model: Path, steps: int, run_dir: Path, extra: list[str]) -> dict:
    """One megarl training run; per step (start, end, step_s, reward) from its progress lines and
    metrics.jsonl."""
    exp = run_dir.name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run (trainer.resume=auto would continue)
    cmd = [
        str(Path(sys.executable).with_name("megarl")),  # this venv's entry point
        "train",
        "configs/quickstart.yaml",
        f"trainer.output_dir={run_dir.parent}",
        f"trainer.experiment_name={exp}",
        f"trainer.total_steps={steps}",
        "trainer.val_every=0",
        f"model.path={model}",
        f"rollout.max_new_tokens={variant.max_new_tokens}",
        *variant.megarl_args,
        *extra,
    ]
    line_times: dict[int, float] = {}

    def on_line(text: str, now: float) -> None:
        words = text.split()
        if len(words) > 1 and words[0] == "step" and "/" in words[1]:
            line_times[int(words[1].split("/")[0])] = now

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    launch, end = run_logged(cmd, run_dir.parent / f"{exp}.log", on_line)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = []
    for m in metrics:
        done = line_times.get(m["step"])
        if done is None:
            raise SystemExit(
                f"bench_vs_trl: no progress line for megarl step {m['step']} (trainer.log_every must be 1)"
            )
        rows.append(
            {
                "start": done - m["perf/step_s"],
                "end": done,
                "step_s": m["perf/step_s"],
                "reward": m["reward/mean"],
                **megarl_stages(m),
            }
        )
    return {"launch": launch, "exit": end, "steps": rows, "metrics_path": str(run_dir / "metrics.jsonl")}


# a step's stages, the same names on both sides (STAGES in the report)
PREP_KEYS = ("perf/old_log_prob_s", "perf/ref_s", "perf/values_s", "perf/reward_s", "perf/adv_s")


def megarl_stages(m: dict) -> dict:
    """perf/* of one megarl step: generation, the batch's preparation (old/ref log-probs where
    computed, values, reward, advantages), the update, and the rest (weight sync, the loop's own)."""
    prep = sum(m.get(k, 0.0) for k in PREP_KEYS)
    return {
        "gen_s": m["perf/gen_s"],
        "prep_s": prep,
        "update_s": m["perf/update_s"],
        "other_s": m["perf/step_s"] - m["perf/gen_s"] - prep - m["perf/update_s"],
    }


def trl_stages(r: dict) -> dict:
    """_trl_grpo.py's time_stages: `_generate`, the rest of `_generate_and_score_completions` (its
    old log-prob pass, reward, advantages), and the optimizer steps (the round's remainder)."""
    if "gen_s" not in r:  # written by an older _trl_grpo.py
        return {}
    return {
        "gen_s": r["gen_s"],
        "prep_s": r["prepare_s"],
        "update_s": r["step_s"] - r["gen_s"] - r["prepare_s"],
        "other_s": None,
    }


def run_trl(variant: Variant, model: Path, train: Path, steps: int, out: Path, python: str) -> dict:
    cmd = [
        python,
        str(ROOT / "benchmarks" / "_trl_grpo.py"),
        "--model",
        str(model),
        "--train",
        str(train),
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--max-new-tokens",
        str(variant.max_new_tokens),
        "--workdir",
        str(out.with_suffix(".workdir")),
    ]
    launch, end = run_logged(cmd, out.with_suffix(".log"))
    records = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    rows = [
        {
            "start": r["start"],
            "end": r["end"],
            "step_s": r["step_s"],
            "reward": r["reward_mean"],
            "trl": r.get("trl", {}),
            **trl_stages(r),
        }
        for r in records
        if r["kind"] == "step"
    ]
    summary = next(r for r in records if r["kind"] == "summary")
    return {"launch": launch, "exit": end, "steps": rows, "trl_summary": summary}


def warmup_of(steps: int, warmup: int) -> int:
    """Warm-up steps left out of the median: none in a run too short to have any after them."""
    return warmup if steps > warmup else 0


def summarize(run: dict, warmup: int) -> dict:
    """The table's numbers of one run (times in s)."""
    steps = run["steps"]
    first_start = steps[0]["start"]
    rewards = [s["reward"] for s in steps]
    reach = next(
        (
            k
            for k in range(REWARD_WINDOW, len(rewards) + 1)
            if sum(rewards[k - REWARD_WINDOW : k]) / REWARD_WINDOW >= REWARD_TARGET
        ),
        None,
    )
    w = min(REWARD_WINDOW, len(rewards))
    after_warmup = steps[warmup_of(len(steps), warmup) :]
    steady = [s["step_s"] for s in after_warmup]
    return {
        "whole_s": run["exit"] - run["launch"],
        "steps_s": steps[-1]["end"] - first_start,
        "sum_step_s": sum(s["step_s"] for s in steps),
        "median_step_s": statistics.median(steady),
        "startup_s": first_start - run["launch"],
        "reach_step": reach,
        "reach_s": steps[reach - 1]["end"] - first_start if reach else None,
        "reward_first": sum(rewards[:w]) / w,
        "reward_last": sum(rewards[-w:]) / w,
        "stages": {
            k: statistics.median(v) if None not in (v := [s.get(k) for s in after_warmup]) else None for k, _ in STAGES
        },
    }


def check_reference_curve(metrics_path: str, steps: int) -> str:
    """megarl's first min(steps, 50) steps against benchmarks/reference_curves/quickstart.jsonl."""
    n = min(steps, REFERENCE_STEPS)
    head = Path(metrics_path).with_name("metrics_head.jsonl")
    head.write_text("".join(Path(metrics_path).read_text().splitlines(keepends=True)[:n]))
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare_curve.py"), str(head)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return f"steps 1..{n} " + (
        "equal to the reference curve"
        if res.returncode == 0
        else f"DEPART from the reference curve: {res.stdout.strip()[-400:]}"
    )


# ------------------------------------------------------------------ report
STAGES = [
    ("gen_s", "generation"),
    ("prep_s", "old log-probs, reward, advantages"),
    ("update_s", "update"),
    ("other_s", "weight sync, the rest"),
]
COLUMNS = [
    ("whole_s", "whole s"),
    ("steps_s", "steps s"),
    ("median_step_s", "s/step"),
    ("startup_s", "start-up s"),
    ("reach_step", "step to 0.9"),
    ("reach_s", "time to 0.9 s"),
]


def fmt(v) -> str:
    return (
        "-"
        if v is None
        else (f"{v:.3f}" if isinstance(v, float) and v < 1 else f"{v:.2f}" if isinstance(v, float) else str(v))
    )


def print_stages(runs: list[dict]) -> None:
    """Where a step went on each side: per stage, the median over a side's runs of each run's
    median (steps after the warm-up); '-' for a side that did not run."""
    med = {}
    for side in SIDES:
        per_run = [r["summary"].get("stages") or {} for r in runs if r["side"] == side]
        med[side] = {
            k: statistics.median(v) if (v := [x[k] for x in per_run if x.get(k) is not None]) else None
            for k, _ in STAGES
        }
    print("\n| stage (s/step, median) | megarl | TRL | megarl/TRL |\n|---|---|---|---|")
    for k, label in STAGES:
        a, b = med["megarl"][k], med["trl"][k]
        ratio = f"{a / b:.2f}x" if a is not None and b else "-"
        print(f"| {label} | {fmt(a)} | {fmt(b)} | {ratio} |")


def report(variant: Variant, runs: list[dict]) -> dict:
    """Print the variant's table; return its medians and ratios."""
    n = len(runs[0]["steps"])
    pairs = len({r["pair"] for r in runs})
    alone = "" if {r["side"] for r in runs} == set(SIDES) else f" ({runs[0]['side']} only)"
    print(
        f"\n### {variant.name}: {pairs} pairs{alone}, {n} steps, s/step = median after "
        f"{warmup_of(n, variant.warmup)} warm-up steps\n"
    )
    print(
        "| pair | side | "
        + " | ".join(label for _, label in COLUMNS)
        + " | reward first -> last 10 | load before/after |"
    )
    print("|---" * (len(COLUMNS) + 4) + "|")
    for r in runs:
        s = r["summary"]
        print(
            f"| {r['pair']} | {r['side']} | "
            + " | ".join(fmt(s[k]) for k, _ in COLUMNS)
            + f" | {s['reward_first']:.3f} -> {s['reward_last']:.3f} | {r['load_before']:.2f} / {r['load_after']:.2f} |"
        )
    medians, ratios = {}, {}
    for side in SIDES:
        mine = [r["summary"] for r in runs if r["side"] == side]
        medians[side] = {
            k: (
                statistics.median(v)
                if mine and len(v := [m[k] for m in mine if m[k] is not None]) == len(mine)
                else None
            )
            for k, _ in COLUMNS
        }
    for k, _ in COLUMNS:
        a, b = medians["megarl"][k], medians["trl"][k]
        ratios[k] = a / b if a is not None and b else None
    print("| median | megarl | " + " | ".join(fmt(medians["megarl"][k]) for k, _ in COLUMNS) + " | | |")
    print("| median | TRL | " + " | ".join(fmt(medians["trl"][k]) for k, _ in COLUMNS) + " | | |")
    print(
        "| ratio | megarl/TRL | "
        + " | ".join("-" if ratios[k] is None else f"{ratios[k]:.2f}x" for k, _ in COLUMNS)
        + " | | |"
    )
    print_stages(runs)
    print(f"\nreward curves ({REWARD_WINDOW}-step means of reward/mean, every {REWARD_WINDOW} steps):")
    for r in runs:
        rewards = [s["reward"] for s in r["steps"]]
        means = [
            sum(rewards[i : i + REWARD_WINDOW]) / len(rewards[i : i + REWARD_WINDOW])
            for i in range(0, len(rewards), REWARD_WINDOW)
        ]
        print(f"  pair {r['pair']} {r['side']:6}: " + " ".join(f"{m:.2f}" for m in means))
        if "curve_check" in r:
            print(f"  pair {r['pair']} megarl: {r['curve_check']}")
    return {"medians": medians, "ratios": ratios}


# ------------------------------------------------------------------ main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="quickstart,compute", help=f"comma list of {sorted(VARIANTS)}")
    p.add_argument("--pairs", type=int, default=3, help="alternating megarl/TRL pairs per variant")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: the variant's)")
    p.add_argument("--trl-python", default=None, help="python of a TRL venv (default: .venv-trl, built if missing)")
    p.add_argument("--megarl-arg", action="append", default=[], help="extra megarl override (repeatable)")
    p.add_argument("--workdir", default=None, help="default: outputs/bench_vs_trl (--smoke: a temp dir)")
    p.add_argument("--json", default=None, help="write everything (per-step curves too) here")
    p.add_argument(
        "--model",
        default=None,
        help="the initial HF checkpoint of both sides (default: the variant's, built; with --model one variant only)",
    )
    p.add_argument("--smoke", action="store_true", help="quickstart, 1 pair of 3 steps; TRL only if installed")
    args = p.parse_args(argv)
    if args.smoke:  # smoke sizes replace the defaults only: flags given explicitly still win
        args.variants = "quickstart" if args.variants == p.get_default("variants") else args.variants
        args.pairs = 1 if args.pairs == p.get_default("pairs") else args.pairs
        args.steps = args.steps or 3
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if args.model and len(names) != 1:
        raise SystemExit("bench_vs_trl: --model is the initial checkpoint of one variant: name one with --variants")
    if unknown or not names or args.pairs < 1:
        raise SystemExit(
            f"bench_vs_trl: --variants must name some of {sorted(VARIANTS)} (got {unknown or names}) "
            f"and --pairs must be >= 1"
        )
    check_reward_equal()
    python = trl_python(args.trl_python, build=not args.smoke)
    sides = SIDES if python else ("megarl",)
    if python is None:
        print(
            "bench_vs_trl: TRL not run: no .venv-trl here and no --trl-python (--smoke does not build it; "
            "bash benchmarks/setup_trl_env.sh does); megarl's side runs alone",
            flush=True,
        )
    temporary = args.workdir is None and args.smoke
    work = Path(
        tempfile.mkdtemp(prefix="bench_vs_trl_") if temporary else args.workdir or ROOT / "outputs" / "bench_vs_trl"
    )
    try:
        departed = run_variants(args, names, python, sides, work.resolve())
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    if departed and args.smoke:
        raise SystemExit("bench_vs_trl: megarl's curve departs from the reference: " + "; ".join(departed))


def run_variants(args, names: list[str], python: str | None, sides: tuple, work: Path) -> list[str]:
    """Every variant's pairs and tables; returns the reference-curve departures (empty if none)."""
    (work / "inputs").mkdir(parents=True, exist_ok=True)
    train = write_train_rows(work / "inputs" / "train.jsonl")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result = {"machine": {"cpus": os.cpu_count(), "load_start": load_avg()}, "args": vars(args), "variants": {}}
    for name in names:
        variant = VARIANTS[name]
        steps = args.steps or variant.steps
        model = Path(args.model).resolve() if args.model else build_model(variant, work / "inputs" / f"model-{name}")
        runs = []
        for pair in range(1, args.pairs + 1):
            for side in sides if pair % 2 else sides[::-1]:
                tag = f"{name}-{stamp}-p{pair}-{side}"
                print(f"bench_vs_trl: {tag} ({steps} steps) ...", flush=True)
                before = load_avg()
                if side == "megarl":
                    run = run_megarl(variant, model, steps, work / "runs" / tag, args.megarl_arg)
                else:
                    run = run_trl(variant, model, train, steps, work / "runs" / f"{tag}.jsonl", python)
                run.update(side=side, pair=pair, load_before=before, load_after=load_avg())
                run["summary"] = summarize(run, variant.warmup)
                if side == "megarl" and name == "quickstart" and not args.megarl_arg:
                    run["curve_check"] = check_reference_curve(run["metrics_path"], steps)
                s = run["summary"]
                print(
                    f"bench_vs_trl: {tag}: whole {s['whole_s']:.1f} s, steps {s['steps_s']:.1f} s, "
                    f"{s['median_step_s']:.3f} s/step, reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}",
                    flush=True,
                )
                runs.append(run)
        result["variants"][name] = {
            "steps": steps,
            "warmup": variant.warmup,
            "model": str(model),
            "max_new_tokens": variant.max_new_tokens,
            "runs": runs,
            **report(variant, runs),
        }
    result["machine"]["load_end"] = load_avg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"\nbench_vs_trl: wrote {args.json}")
    return [
        f"{name} pair {r['pair']}: {r['curve_check']}"
        for name, v in result["variants"].items()
        for r in v["runs"]
        if "DEPART" in r.get("curve_check", "")
    ]


if __name__ == "__main__":
    main()
