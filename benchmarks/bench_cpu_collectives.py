"""Shared-memory collectives (megarl/engine/megatron/cpu/collectives.py) against gloo, op by op.

    .venv/bin/python benchmarks/bench_cpu_collectives.py [--ranks 2] [--iters 300] [--json out.json]
    .venv/bin/python benchmarks/bench_cpu_collectives.py --smoke    # 10 calls, 1 block per side

Two (or --ranks) processes on this host; each op runs --iters times back to back through
shared memory and through gloo's own function (the original the module wraps), alternating in
blocks so both see the same minute of machine noise; the median of --blocks (5) blocks per side is printed
in microseconds per call, with gloo / shared memory. Before timing, every op's result through shared
memory is checked against gloo's on the same inputs. The sizes are the quickstart's: the MoE
dispatcher's all-to-all of ~100 token rows of 64 floats, its per-layer count all-gather, a loss
all-reduce of a few scalars, and the distributed optimizer's reduce-scatter / all-gather of the
tiny model's 0.5 MB of gradients; and of 16 MB (the compute variant's 17.6 MB of gradients go in
rounds through the 4 MB slot; --iters / 30 calls per block for those).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCKS = 5


def _cases(n: int, rank: int):
    rows = torch.randn(96, 64)
    counts, gathered = torch.arange(4, dtype=torch.int64), torch.empty(4 * n, dtype=torch.int64)
    scalars = torch.randn(4)
    grads, shard = torch.randn(n * 64 * 1024), torch.empty(64 * 1024)
    params = torch.empty(n * 64 * 1024)
    big_grads, big_shard = torch.randn(n * 2 * 1024 * 1024), torch.empty(2 * 1024 * 1024)
    big_params = torch.empty(n * 2 * 1024 * 1024)
    splits = [96 // n] * n
    a2a_out = torch.empty(sum(splits), 64)
    return {
        "all_to_all_single 96x64 fp32": lambda f: f["all_to_all_single"](a2a_out, rows, splits, splits),
        "all_gather_into_tensor 4 int64": lambda f: f["all_gather_into_tensor"](gathered, counts),
        "all_reduce 4 fp32": lambda f: f["all_reduce"](scalars.clone()),
        "reduce_scatter_tensor 256 KB/rank": lambda f: f["reduce_scatter_tensor"](shard, grads),
        "all_gather_into_tensor 256 KB/rank": lambda f: f["all_gather_into_tensor"](params, shard),
        "reduce_scatter_tensor 16 MB -> 8 MB (rounds of the 4 MB slot)": lambda f: f["reduce_scatter_tensor"](
            big_shard, big_grads
        ),
        "all_gather_into_tensor 8 MB -> 16 MB (rounds)": lambda f: f["all_gather_into_tensor"](big_params, big_shard),
        "barrier": lambda f: f["barrier"](),
    }


def _results(fns: dict, n: int, x: torch.Tensor) -> dict:
    """What each op gives for the rank's input `x` (numel divisible by n) through `fns`."""
    out = {"all_reduce": x.clone()}
    fns["all_reduce"](out["all_reduce"])
    out["reduce_scatter_tensor"] = torch.empty(x.numel() // n)
    fns["reduce_scatter_tensor"](out["reduce_scatter_tensor"], x)
    out["all_gather_into_tensor"] = torch.empty(x.numel() * n)
    fns["all_gather_into_tensor"](out["all_gather_into_tensor"], x)
    out["all_to_all_single"] = torch.empty_like(x)
    fns["all_to_all_single"](out["all_to_all_single"], x, [x.numel() // n] * n, [x.numel() // n] * n)
    out["broadcast"] = x.clone()
    fns["broadcast"](out["broadcast"], src=0)
    return out


def _check_against_gloo(shm: dict, cc, rank: int, n: int) -> None:
    """Shared memory must give gloo's results (a timing of wrong answers is no benchmark): rank-
    dependent inputs of a few floats and of 8 MB a rank (in rounds of the 4 MB slot)."""
    for numel in (8 * n, (1 << 21) * n):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        want, got = _results(cc._orig, n, x), _results(shm, n, x)
        for op, value in want.items():
            if not torch.allclose(got[op], value, rtol=1e-5, atol=1e-6):
                err = (got[op] - value).abs().max().item()
                raise AssertionError(f"{op} of {numel} floats: shared memory differs from gloo by {err:.3g}")


def _rank(rank: int, n: int, store: str, iters: int, blocks: int, out: str) -> None:
    import torch.distributed as dist

    from megarl.engine.megatron.cpu import collectives as cc

    torch.set_num_threads(1)
    os.environ[cc.ENV] = "shm"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n)
    cc.install()
    shm = {name: getattr(dist, name) for name in cc._orig}
    _check_against_gloo(shm, cc, rank, n)
    results = {}
    for name, run in _cases(n, rank).items():
        times = {"shm": [], "gloo": []}
        for _ in range(blocks):
            for side, fns in (("gloo", cc._orig), ("shm", shm)):
                calls = max(iters // 30, 3) if "MB" in name else iters  # the large ones: fewer calls
                for _ in range(min(calls, 10)):
                    run(fns)
                cc._orig["barrier"]()
                t = time.perf_counter()
                for _ in range(calls):
                    run(fns)
                times[side].append((time.perf_counter() - t) / calls * 1e6)
        results[name] = {side: statistics.median(v) for side, v in times.items()}
    assert isinstance(cc._channels.get(dist.group.WORLD), cc.Channel), "shared memory was not used"
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--blocks", type=int, default=BLOCKS, help="alternating blocks per side (the median is printed)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="10 calls, 1 block (checks the script)")
    args = p.parse_args(argv)
    if args.smoke:  # smoke sizes replace the defaults only: flags given explicitly still win
        args.iters = 10 if args.iters == p.get_default("iters") else args.iters
        args.blocks = 1 if args.blocks == BLOCKS else args.blocks
    tmp = tempfile.mkdtemp(prefix="bench_cpu_collectives_")
    atexit.register(shutil.rmtree, tmp, True)
    out = os.path.join(tmp, "out.json")
    mp.start_processes(
        _rank,
        args=(args.ranks, os.path.join(tmp, "store"), args.iters, args.blocks, out),
        nprocs=args.ranks,
        start_method="spawn",
    )
    results = json.loads(Path(out).read_text())
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"{args.ranks} ranks, {args.iters} calls x {args.blocks} blocks per side, load average {' '.join(load)}\n")
    print("| op | gloo us/call | shared memory us/call | gloo / shared memory |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['gloo']:.0f} | {r['shm']:.0f} | {r['gloo'] / r['shm']:.1f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": args.ranks, "load": load, "us_per_call": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
