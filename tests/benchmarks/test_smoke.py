"""Every benchmark script runs end to end in its smoke mode (`--smoke`: tiny sizes, one repeat).

Each test runs one script as its own process, `sys.executable benchmarks/SCRIPT --smoke ...`, the way
a person runs it, and checks the exit status and the rows of the table it prints: a benchmark whose
imports, code path or checks break fails here, not on the day someone needs its numbers. The scripts
check what they measure (parity, bit-exact round trips, equal logits, a reference curve) and exit
non-zero when a check fails, so a passing smoke run is more than "it did not crash".

Shared, to keep the whole directory to a few minutes on 2 cores:
- the session's tiny Qwen3-MoE checkpoint (tests/conftest.py's `tiny_model_path`: the weights the
  quickstart builds from its preset, seed 0) is the model of every run that takes one, and
  bench_rollout.py's modes build theirs once in one work directory;
- the cores: the scripts that keep one core busy (one process at a time, one torch thread) run two
  at a time, started together when the first of their tests runs; the scripts with several busy
  processes (gloo ranks, Ray, engines with tp=2) run alone, after those have finished.
Every process runs with one torch thread (the scripts' own settings; OMP_NUM_THREADS=1 for the rest).
All tests carry the `benchmark_smoke` marker (deselect them with -m "not benchmark_smoke").
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

pytestmark = pytest.mark.benchmark_smoke

# script -> the test that runs its smoke mode (every benchmark script must have one)
COVERED = {
    "bench_async.py": "test_bench_async",
    "bench_bridge.py": "test_bench_bridge",
    "bench_convert.py": "test_bench_convert",
    "bench_cpu_collectives.py": "test_bench_cpu_collectives",
    "bench_engine.py": "test_bench_engine",
    "bench_generate_path.py": "test_bench_generate_path",
    "bench_gpu.py": "test_bench_gpu",
    "bench_gpu_plan.py": "test_bench_gpu_plan",
    "bench_kv_cache.py": "test_bench_kv_cache",
    "bench_learning.py": "test_bench_learning",
    "bench_logprob.py": "test_bench_logprob",
    "bench_mfu.py": "test_bench_mfu",
    "bench_plan.py": "test_bench_plan",
    "bench_rollout.py": "test_bench_rollout",
    "bench_smollm2.py": "test_bench_smollm2",
    "bench_sync_plan.py": "test_bench_sync_plan",
    "bench_vs_trl.py": "test_bench_vs_trl",
    "gpu_probe.py": "test_gpu_probe",
    "gpu_replay.py": "test_gpu_replay",
    "profile_step.py": "test_profile_step",
}


def smoke_command(script: str, *args: str) -> list[str]:
    return [sys.executable, str(BENCHMARKS / script), "--smoke", *args]


def run_smoke(cmd: list[str], timeout: float = 300) -> tuple[int | None, str, float]:
    """(exit status or None on a timeout, stdout + stderr, seconds) of one smoke command, run from
    the repo root."""
    from megarl.procs.net import free_port

    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # the single-process scripts' torch.distributed rendezvous: a free port, not their fixed default
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port("127.0.0.1")),
    }
    start = time.monotonic()
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return None, out, time.monotonic() - start
    return done.returncode, done.stdout, time.monotonic() - start


def checked(cmd: list[str], result: tuple[int | None, str, float], timeout: float = 300) -> str:
    """The output of a smoke run that exited 0; fails the test with the output's tail otherwise."""
    rc, out, seconds = result
    what = " ".join(Path(c).name if i < 2 else c for i, c in enumerate(cmd))
    print(f"{what}: {seconds:.1f} s")
    if rc is None:
        pytest.fail(f"{what} ran past {timeout} s; output's tail:\n{out[-6000:]}")
    assert rc == 0, f"{what} exited {rc}; output's tail:\n{out[-6000:]}"
    return out


def smoke(script: str, *args: str, timeout: float = 300) -> str:
    cmd = smoke_command(script, *args)
    return checked(cmd, run_smoke(cmd, timeout), timeout)


def assert_lines(out: str, *fragments: str) -> None:
    """Every fragment is in the output (the table's header and rows the script prints)."""
    missing = [f for f in fragments if f not in out]
    assert not missing, f"missing from the output: {missing}\noutput's tail:\n{out[-6000:]}"


# ---- the scripts that keep one core busy: two at a time ----------------------------------------------
class Pair:
    """Smoke commands run two at a time in the background, each test collecting its own;
    `out_dirs`: the --out folders of the scripts that write their results there."""

    def __init__(self, commands: dict[str, list[str]], out_dirs: dict[str, Path]):
        self.commands, self.out_dirs = commands, out_dirs
        self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="smoke")
        self.futures = {name: self.pool.submit(run_smoke, cmd) for name, cmd in commands.items()}

    def output(self, name: str) -> str:
        return checked(self.commands[name], self.futures[name].result())

    def drain(self) -> None:
        """Wait for every command (before a run that needs the cores to itself)."""
        concurrent.futures.wait(self.futures.values())

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def rollout_workdir(tmp_path_factory, tiny_model_path) -> Path:
    """bench_rollout.py's --workdir: its `tiny` model is the session's checkpoint (same preset and
    seed, so the script finds it built and only reads it)."""
    workdir = tmp_path_factory.mktemp("bench_rollout")
    (workdir / "tiny").symlink_to(tiny_model_path, target_is_directory=True)
    return workdir


@pytest.fixture(scope="module")
def pair(request, tiny_model_path, rollout_workdir, tmp_path_factory):
    """The one-core scripts of the selected tests, started two at a time when first asked for."""
    out = {name: tmp_path_factory.mktemp(name) for name in ("bench_gpu", "bench_gpu_plan", "gpu_probe", "gpu_replay")}
    commands = {
        "test_bench_kv_cache": smoke_command("bench_kv_cache.py"),
        "test_bench_engine": smoke_command("bench_engine.py"),
        "test_bench_mfu": smoke_command("bench_mfu.py"),
        "test_bench_generate_path": smoke_command("bench_generate_path.py", "--model", str(tiny_model_path)),
        "test_bench_convert": smoke_command("bench_convert.py"),
        "test_bench_logprob": smoke_command("bench_logprob.py"),
        "test_bench_gpu": smoke_command("bench_gpu.py", "--out", str(out["bench_gpu"])),
        "test_bench_gpu_plan": smoke_command("bench_gpu_plan.py", "--out", str(out["bench_gpu_plan"])),
        "test_gpu_probe": smoke_command("gpu_probe.py", "--out", str(out["gpu_probe"])),
        "test_gpu_replay": smoke_command("gpu_replay.py", "--out", str(out["gpu_replay"])),
        "test_bench_rollout[default]": smoke_command("bench_rollout.py", "--workdir", str(rollout_workdir)),
        "test_bench_rollout[--mixed]": smoke_command("bench_rollout.py", "--workdir", str(rollout_workdir), "--mixed"),
    }
    selected = {item.name for item in request.session.items}
    runner = Pair({name: cmd for name, cmd in commands.items() if name in selected}, out)
    yield runner
    runner.close()


def test_every_benchmark_script_has_a_smoke_test():
    scripts = sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
    assert scripts == sorted(COVERED), "a benchmark script without a smoke test (or a test of a removed one)"
    tests = {name for name in globals() if name.startswith("test_")}
    for script, test in COVERED.items():
        assert test in tests, f"{script}: {test} is not defined"
        assert "--smoke" in (BENCHMARKS / script).read_text(), f"{script} has no --smoke flag"


def test_bench_learning():
    """The analysis on curves built in code (no run): samples to the trailing mean and the ratio."""
    out = smoke("bench_learning.py", timeout=60)
    assert_lines(out, "| sync | 20 | 11 | 2816 | 1.00x |", "| fully_async | 20 | 13 | 3328 | 1.18x |")


def test_bench_kv_cache(pair):
    out = pair.output("test_bench_kv_cache")
    assert_lines(out, "| rows x prompt | rows leave |", "| 4 x 8+6 | no |", "| 4 x 8+6 | one per step |")


def test_bench_engine(pair):
    out = pair.output("test_bench_engine")
    assert_lines(out, "| layout | tokens/s |", "| padded |", "| packed |", "| train |", "| forward |")


def test_bench_mfu(pair):
    out = pair.output("test_bench_mfu")
    assert_lines(out, "| mid | train | megarl |", "| mid | forward | HF peer |", "| mid | train | megarl / peer |")


def test_bench_generate_path(pair):
    out = pair.output("test_bench_generate_path")
    assert_lines(
        out, "| client.generate (HTTP) |", "| engine alone |", "| HF generate |", "| parse_generate (server) |"
    )


def test_bench_convert(pair):
    out = pair.output("test_bench_convert")
    assert_lines(out, "tiny: safetensors", "hf-to-mcore", "mcore-to-hf", "round trip bit-exact")


def test_bench_logprob(pair):
    """Fused (both modes) vs full log-prob head at 64 tokens x 4096 (chunks of 16): equal, then measured."""
    out = pair.output("test_bench_logprob")
    assert_lines(out, "| pass | variant | added peak MiB |", "| forward | full |", "| train+entropy | fused-keep |")
    assert_lines(out, "bit-identical", "time ratio fused-recompute / full", "time ratio fused-keep / full")
    assert out.strip().splitlines()[-1].startswith("peak memory ratio "), out[-2000:]


def test_bench_gpu(pair):
    """Without CUDA its stages run on the CPU (gloo) at tiny widths; with CUDA, on the GPU."""
    out = pair.output("test_bench_gpu")
    assert_lines(out, "| model | side | train tok/s |", "| moe ", "| dense ", "| | engine / hf |")
    assert (pair.out_dirs["bench_gpu"] / "bench_gpu.json").exists()


def test_bench_gpu_plan(pair):
    out = pair.output("test_bench_gpu_plan")
    assert_lines(out, "| model | recompute |", "| moe | none |", "| moe | full |", "| dense | selective |")


def test_gpu_probe(pair):
    out = pair.output("test_gpu_probe")
    assert_lines(out, "gpu_probe: every stage ok on", "env, ipc, engine, hf_speed, engine_speed")


def test_gpu_replay(pair):
    pair.output("test_gpu_replay")
    result = json.loads((pair.out_dirs["gpu_replay"] / "gpu_replay.json").read_text())
    assert result["ok"] and all(result["checks"].values()), result


ROLLOUT_ROWS = {
    "default": ["| tiny (0.13 M) | HF generate (peer) |", "| megarl server, RolloutClient |", "1 batched request"],
    "--mixed": ["| tiny (0.13 M) | HF generate, static batches of 4 |", "continuous batching |", "joins per run"],
    "--mesh": ["| 1 engine, tp=1 |", "| 1 engine, tp=2 (2 processes) |", "behind sglang-router", "requests per engine"],
}


@pytest.mark.parametrize("mode", list(ROLLOUT_ROWS))
def test_bench_rollout(mode, pair, rollout_workdir, request):
    if mode != "--mesh":
        out = pair.output(request.node.name)
    else:  # 5 engine processes and a router: alone
        pair.drain()
        out = smoke("bench_rollout.py", "--workdir", str(rollout_workdir), mode)
    assert_lines(out, "| model (params) | path | tokens |", *ROLLOUT_ROWS[mode])


# ---- several busy processes: each alone --------------------------------------------------------------
def test_bench_cpu_collectives(pair):
    """Two ranks whose shared-memory waits spin: both cores."""
    pair.drain()
    out = smoke("bench_cpu_collectives.py")
    assert_lines(out, "| op | gloo us/call |", "| all_to_all_single 96x64 fp32 |", "| barrier |")


def test_bench_bridge(pair):
    """The weight sync of a real 2-rank Megatron trainer into a tp=2 engine, every transport (the disk
    transport through the server's --weight-dirs confinement), each with its parity check."""
    pair.drain()
    out = smoke("bench_bridge.py", "--transports", "tensor,distributed,reshard,disk", timeout=600)
    assert_lines(
        out,
        "| trainer | transport | sync s |",
        "| EP=2 | tensor |",
        "| EP=2 | distributed |",
        "| EP=2 | reshard |",
        "| EP=2 | disk |",
        "| EP=2 | 1 (rank 0, export_weights) |",
        "summary: sync EP=2",
    )
    assert "FAILED" not in out


# whole training runs: Ray, two Megatron ranks, an engine
def test_bench_async(pair, tiny_model_path):
    pair.drain()
    out = smoke("bench_async.py", "--model", str(tiny_model_path), timeout=600)
    assert_lines(out, "samples/s", "steady/s", "fully_async ")


def test_bench_smollm2(pair):
    pair.drain()
    out = smoke("bench_smollm2.py", timeout=600)
    assert_lines(out, "stage     megarl s", "gen ", "update ", "sync ", "HF generate", "copy_ of the state dict (")


def test_bench_plan(pair, tiny_model_path):
    pair.drain()
    out = smoke("bench_plan.py", "--model", str(tiny_model_path), timeout=600)
    assert_lines(out, "| published run | metric |", "| pp2 ep1 (out of sample) | step s |", "| optimizer MiB |")


def test_bench_sync_plan(pair):
    pair.drain()
    out = smoke("bench_sync_plan.py")
    assert_lines(
        out, "| published sync | transport priced |", "| NeMo-RL DeepSeek-V3", "| reshard |", "| distributed |"
    )


def test_profile_step(pair, tiny_model_path):
    pair.drain()
    out = smoke("profile_step.py", f"model.path={tiny_model_path}", timeout=600)
    assert_lines(out, "steps measured", "| stage | median s |", "| update |", "| process | CPU s per step |")
    assert_lines(out, "| megatron rank |", "| rollout engine |", "| driver |")


def test_bench_vs_trl(pair, tiny_model_path):
    """megarl's side of the comparison (TRL's venv is benchmark-only: without it the script says it
    did not run TRL), its first steps checked against the reference curve."""
    pair.drain()
    out = smoke("bench_vs_trl.py", "--model", str(tiny_model_path), timeout=600)
    assert_lines(out, "### quickstart:", "| 1 | megarl |", "steps 1..3 equal to the reference curve")
    if "TRL not run" not in out:
        assert_lines(out, "| 1 | trl |")
