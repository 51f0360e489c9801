"""Where one quickstart step's time goes, in every process of the run.

    .venv/bin/python benchmarks/profile_step.py [--steps 60] [--warmup 15] [--no-spy] [--json out.json]
                                                [override ...]

Runs `megarl train configs/quickstart.yaml` (validation and tensorboard off; extra `key=value`
overrides go through) and, once `--warmup` steps have passed, measures the steady state over
the following steps:

1. Stage times: the median over the measured steps of each `perf/*_s` the loop logs (generation,
   old log-probs, update, weight sync, ...), and the step itself.
2. CPU per process: each process's CPU seconds (utime + stime from /proc) over the window,
   divided by the steps in it. Processes are the driver, each Megatron rank, the rollout engine,
   and Ray's own (raylet, GCS, dashboard and its agents, idle workers), told apart by command
   line. On 2 cores, 2 CPU-seconds per wall second is the machine.
3. Compute vs overhead (py-spy, unless --no-spy): each process is sampled (py-spy --nonblocking,
   100 Hz) over the window, and every sample is put in the first category whose frame is on its
   stack, most specific first: collectives (gloo, or cpu_collectives' shared memory: its waits
   spin, so a peer's lateness shows here as busy time), autograd backward, optimizer step, model
   forward (torch modules), HTTP/JSON, Ray RPC and (de)serialisation (the innermost frames only),
   torch ops elsewhere, megarl's own code, other. py-spy sees Python frames only, so "model
   forward" is the time inside module forwards, kernels and Python around them together; the
   plain-torch peer in bench_vs_trl.py gives the same math's cost without the framework.

Prints the tables in RESULTS.md's format. Timing noise on this shared machine is 20-35% from
minute to minute: compare before/after runs made back to back.

--smoke: 4 steps, 1 of warm-up, the run in a temporary output directory (removed at the end):
checks the script, the process accounting and py-spy's categories in one short run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY_SPY = Path(sys.executable).with_name("py-spy")

# (name, pattern on the command line), first match wins
PROCESS_KINDS = [
    ("megatron rank", re.compile(r"ray::(MegatronActor|actor)")),
    ("rollout engine", re.compile(r"megarl\.rollout\.server")),
    ("rollout engine TP rank", re.compile(r"multiprocessing\.spawn")),  # --tp > 1: ranks 1.. (mesh.py)
    ("engine launcher", re.compile(r"ray::EngineLauncher|ray::rollout_")),
    ("ray raylet", re.compile(r"raylet")),
    ("ray gcs", re.compile(r"gcs_server")),
    ("ray dashboard + agents", re.compile(r"dashboard|agent\.py|runtime_env|log_monitor|monitor\.py")),
    ("ray idle worker", re.compile(r"default_worker\.py|ray::IDLE")),
]

# (category, frame pattern): the first category with a frame on the sample's stack. Ray's
# pattern is matched against the innermost frames only (RAY_INNERMOST): a rank's every stack
# starts in Ray's worker loop, which would otherwise claim all the rank's own code.
CATEGORIES = [
    (
        "collective (gloo, shared memory)",
        re.compile(r"distributed_c10d\.py|megarl/engine/megatron/cpu/(collectives|shm_channel)\.py"),
    ),
    ("autograd backward", re.compile(r"_engine_run_backward|run_backward")),
    ("optimizer step", re.compile(r"\bmegatron/core/optimizer/")),
    ("model forward", re.compile(r"\btorch/nn/modules/module\.py")),
    (
        "HTTP / JSON",
        re.compile(r"\b(fastapi|starlette|uvicorn|httpx|httpcore|h11|anyio)/|\bjson/(encoder|decoder)\.py"),
    ),
    ("Ray RPC, serialisation, idle loop", re.compile(r"\bray/|pickle|serializ")),
    ("torch ops elsewhere", re.compile(r"\btorch/")),
    ("megarl (batches, packing, loss, bridge)", re.compile(r"\bmegarl/")),
]
RAY_INNERMOST = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="steps the run makes")
    p.add_argument("--warmup", type=int, default=15, help="steps before measuring")
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--no-spy", action="store_true", help="CPU accounting and stage times only")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--output-dir", default=None, help="trainer.output_dir (default: outputs; --smoke: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="4 steps, 1 of warm-up (checks the script)")
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = p.parse_args(argv)
    if args.smoke:  # smoke sizes replace the defaults only: flags given explicitly still win
        args.steps = 4 if args.steps == p.get_default("steps") else args.steps
        args.warmup = 1 if args.warmup == p.get_default("warmup") else args.warmup
    return args


def _children(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = []  # every thread's: the driver's Ray processes are forked by its Ray-start thread
        for task in Path(f"/proc/{p}/task").glob("*") if Path(f"/proc/{p}/task").is_dir() else ():
            try:
                kids += (task / "children").read_text().split()
            except OSError:
                continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def kind_of(cmdline: str, driver: bool) -> str:
    if driver:
        return "driver"
    for name, pattern in PROCESS_KINDS:
        if pattern.search(cmdline):
            return name
    return "other"


def _steps_done(metrics: Path) -> int:
    try:
        return sum(1 for _ in metrics.open())
    except OSError:
        return 0


def categorise(raw: Path) -> collections.Counter:
    """py-spy raw output ('frame;frame;... count' per line) -> samples per category."""
    counts: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        innermost = ";".join(stack.split(";")[-RAY_INNERMOST:])
        for name, pattern in CATEGORIES:
            if pattern.search(innermost if name.startswith("Ray") else stack):
                counts[name] += int(n)
                break
        else:
            counts["other"] += int(n)
    return counts


def run(args, output_dir: Path) -> dict:
    exp = f"profile_step_{os.getpid()}"
    metrics = output_dir / exp / "metrics.jsonl"
    cmd = [
        str(Path(sys.executable).with_name("megarl")),
        "train",
        args.config,
        f"trainer.output_dir={output_dir}",
        f"trainer.experiment_name={exp}",
        f"trainer.total_steps={args.steps}",
        "trainer.loggers=[console,jsonl]",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "trainer.export_hf=false",
        *args.overrides,
    ]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    spy_dir = Path(tempfile.mkdtemp(prefix="profile_step_"))
    try:
        while _steps_done(metrics) < args.warmup:
            if proc.poll() is not None:
                raise SystemExit(f"profile_step: the run ended before step {args.warmup}; log: {log.name}")
            time.sleep(0.02)
        pids = {pid: kind_of(_cmdline(pid), pid == proc.pid) for pid in [proc.pid, *_children(proc.pid)]}
        # Ray's processes are children of the driver (a local cluster); workers of the raylet
        start_step, t0 = _steps_done(metrics), time.perf_counter()
        cpu0 = {pid: _cpu_seconds(pid) for pid in pids}
        spies = []
        if not args.no_spy:
            for pid, kind in pids.items():
                if kind in ("driver", "megatron rank", "rollout engine"):
                    out = spy_dir / f"{kind.replace(' ', '_')}_{pid}.txt"
                    spies.append(
                        (
                            pid,
                            kind,
                            out,
                            subprocess.Popen(
                                [
                                    str(PY_SPY),
                                    "record",
                                    "-p",
                                    str(pid),
                                    "-r",
                                    str(args.rate),
                                    "--nonblocking",
                                    "--format",
                                    "raw",
                                    "-o",
                                    str(out),
                                ],
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL,
                            ),
                        )
                    )
        # each process's CPU time is read on every tick, its last reading kept: a run whose last
        # steps take less than a tick ends, and its Ray workers with it, before the loop sees it
        cpu1 = dict(cpu0)
        while True:
            done = _steps_done(metrics)
            cpu1.update({pid: t for pid in pids if (t := _cpu_seconds(pid)) is not None})
            if done >= args.steps - 1 or proc.poll() is not None:
                break
            time.sleep(0.02)
        end_step, wall = done, time.perf_counter() - t0
        for _, _, _, spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for _, _, _, spy in spies:
            spy.wait(timeout=60)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)
    steps = end_step - start_step
    rows = [json.loads(line) for line in metrics.open()][start_step:end_step]
    stage_keys = sorted({k for r in rows for k in r if k.startswith("perf/") and k.endswith("_s")})
    stages = {k[len("perf/") : -2]: statistics.median(r.get(k, 0.0) for r in rows) for k in stage_keys}
    cpu: dict[str, float] = collections.defaultdict(float)
    for pid, kind in pids.items():
        if cpu0.get(pid) is not None and cpu1.get(pid) is not None:
            cpu[kind] += (cpu1[pid] - cpu0[pid]) / steps
    spied = {}
    for pid, kind, out, _ in spies:
        if out.exists():
            counts = categorise(out)
            total = sum(counts.values()) or 1
            spied[f"{kind} {pid}"] = {k: v / total for k, v in counts.most_common()}
    return {
        "command": " ".join(cmd),
        "steps_measured": steps,
        "wall_per_step_s": wall / steps,
        "stages_s": stages,
        "cpu_s_per_step": dict(cpu),
        "py_spy_shares": spied,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "log": log.name,
    }


def report(res: dict) -> str:
    lines = [
        f"{res['steps_measured']} steps measured, {res['wall_per_step_s']:.3f} s/step wall "
        f"(load average {' '.join(res['loadavg'])})",
        "",
        "| stage | median s |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:.3f} |" for k, v in res["stages_s"].items()]
    lines += ["", "| process | CPU s per step |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in sorted(res["cpu_s_per_step"].items(), key=lambda kv: -kv[1])]
    lines.append(f"| all | {sum(res['cpu_s_per_step'].values()):.3f} |")
    if res["py_spy_shares"]:
        cats = [c for c, _ in CATEGORIES] + ["other"]
        procs = list(res["py_spy_shares"])
        lines += ["", "| share of samples | " + " | ".join(procs) + " |", "|---" * (len(procs) + 1) + "|"]
        for c in cats:
            lines.append(f"| {c} | " + " | ".join(f"{res['py_spy_shares'][p].get(c, 0.0):.0%}" for p in procs) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.warmup >= args.steps - 2:
        raise SystemExit(f"--warmup {args.warmup} leaves no steps to measure of --steps {args.steps}")
    temporary = args.output_dir is None and args.smoke
    output_dir = Path(tempfile.mkdtemp(prefix="profile_step_run_") if temporary else args.output_dir or "outputs")
    try:
        res = run(args, REPO / output_dir)
    finally:
        if temporary:
            shutil.rmtree(output_dir, ignore_errors=True)
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
