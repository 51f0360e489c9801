"""Compare a run's per-step metrics with a checked-in reference curve, and say where it departs.

    python scripts/compare_curve.py outputs/quickstart/metrics.jsonl
    python scripts/compare_curve.py RUN.jsonl --reference benchmarks/reference_curves/quickstart.jsonl
    python scripts/compare_curve.py RUN.jsonl --update      # make RUN the new reference

The quickstart is deterministic on a given machine (two runs agree step for step), so the default
tolerance is tight: a departure means the change moved learning, or numerics, and the commit
that moves the curve updates the reference (--update) and says why. Exit status: 0 when every
compared step of every key is within tolerance, 1 otherwise, 2 on unusable input. Steps past the
end of the shorter file are not compared (a 30-step run checks the reference's first 30 steps).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REFERENCE = ROOT / "benchmarks" / "reference_curves" / "quickstart.jsonl"
# What learning looks like: reward, the policy's drift and entropy, the gradient, the loss.
KEYS = [
    "reward/mean",
    "actor/ppo_kl",
    "actor/kl",
    "actor/entropy",
    "rollout/entropy",
    "actor/grad_norm",
    "actor/pg_loss",
    "response/length_mean",
]


def read_curve(path: Path) -> dict[int, dict[str, float]]:
    curve = {}
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                curve[int(row["step"])] = {k: float(v) for k, v in row.items() if k != "step"}
            except (ValueError, KeyError, TypeError) as exc:
                raise SystemExit(f"compare_curve: {path}:{line_no} is not a metrics row ({exc})") from None
    if not curve:
        raise SystemExit(f"compare_curve: {path} has no steps")
    return curve


def compare(run: dict, ref: dict, keys: list[str], atol: float, rtol: float) -> tuple[list[str], dict]:
    """(departures as readable lines, the worst |difference| per key)."""
    steps = sorted(set(run) & set(ref))
    departures, worst = [], {}
    for key in keys:
        present = [s for s in steps if key in ref[s]]
        if not present:
            continue
        worst[key] = (0.0, present[0])
        for step in present:
            expected, got = ref[step][key], run[step].get(key, math.nan)
            diff = abs(got - expected)
            if not diff <= worst.get(key, (0.0, 0))[0]:  # also records NaN
                worst[key] = (diff, step)
            if not diff <= atol + rtol * abs(expected):
                departures.append(
                    f"{key}: first departs at step {step}: {got:.6g} vs reference {expected:.6g} (|diff| {diff:.3g})"
                )
                break
    return departures, worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="metrics.jsonl of the run to check")
    parser.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE)
    parser.add_argument("--keys", nargs="*", default=KEYS)
    parser.add_argument("--atol", type=float, default=1e-6)
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--update", action="store_true", help="copy RUN over the reference")
    args = parser.parse_args(argv)
    if args.update:
        args.reference.parent.mkdir(parents=True, exist_ok=True)
        curve = read_curve(args.run)  # timings are the machine's, not learning: left out
        args.reference.write_text(
            "".join(
                json.dumps({"step": step, **{k: v for k, v in row.items() if not k.startswith("perf/")}}) + "\n"
                for step, row in sorted(curve.items())
            )
        )
        print(f"compare_curve: {args.reference} now holds {len(read_curve(args.reference))} steps of {args.run}")
        return 0
    run, ref = read_curve(args.run), read_curve(args.reference)
    steps = sorted(set(run) & set(ref))
    if not steps:
        print(f"compare_curve: {args.run} and {args.reference} share no step", file=sys.stderr)
        return 2
    departures, worst = compare(run, ref, args.keys, args.atol, args.rtol)
    print(f"compare_curve: {len(steps)} steps ({steps[0]}..{steps[-1]}) of {args.run} against {args.reference}")
    for key, (diff, step) in sorted(worst.items()):
        print(f"  {key:24s} max |diff| {diff:.3g} (step {step})")
    if departures:
        print(f"DEPARTS (atol {args.atol}, rtol {args.rtol}):\n  " + "\n  ".join(departures))
        return 1
    print(f"matches the reference within atol {args.atol}, rtol {args.rtol}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
