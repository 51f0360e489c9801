"""Weight sync from a real 2-rank Megatron trainer to one tp=2 embedded engine, every transport,
each against a raw peer on the same bytes and the same processes.

    .venv/bin/python benchmarks/bench_bridge.py [--layouts ep2,pp2] [--repeats 5] [--bucket-mb 64]
    .venv/bin/python benchmarks/bench_bridge.py --smoke     # every transport on a 4 MiB model, 1 repeat

Set-up: a Qwen3-MoE checkpoint of 108 MiB fp32 built in code (hidden 512, 4 layers, 8 experts;
the size flags change it); one embedded engine `python -m megarl.rollout.server --tp 2
--torch-threads 1` on it (2 processes); a Megatron trainer (MegatronEngine, Adam) on 2 spawned
gloo ranks with layout EP=2 (`--layouts ep2,pp2` adds PP=2). Every process uses one torch thread.

Per transport (tensor, disk, distributed, reshard): one untimed warm-up sync (groups, plans,
buffers), then --repeats timed syncs; the reported time is the median of the slowest rank's
`transport.sync` wall time. Before every sync the trainer takes a real optimizer step (lr 1e-3),
and after every sync the engine's log-probs of 4 fixed token rows must equal the trainer's
`compute_log_prob` within --atol (the max error is reported; before the first sync the same check
is run on the stale engine and must fail, so it has teeth).

Sections printed:
  1. sync time, GB/s (1e9 B/s of model bytes) and parity, per layout and transport;
  2. peers on the same bytes, ratio = peer s / transport s (1.0 = as fast as the raw operation):
     tensor: torch.cat per bucket + copy_ into preallocated tensors (one process);
     disk: safetensors save_file + load_file of the full model;
     distributed: raw gloo broadcast of exactly the buckets the transport sent, 1 sender + as many
       receivers as engine ranks, preallocated buffers;
     reshard: raw gloo isend/irecv of exactly the plan's messages (sizes, sender->receiver pairs),
       both trainer ranks sending at once to the engine ranks, preallocated buffers;
     the gloo peers run twice: warm preallocated buffers (the raw wire; the ratio), and buffers
       allocated anew every run with the senders packing into them (what any transport pays for
       memory it has not touched yet: page faults and one copy);
  3. bytes received per rollout rank and total bytes moved, distributed vs reshard;
  4. distributed as shipped (every EP owner / PP stage sends) vs a rank-0 funnel (a benchmark-local
     subclass: rank 0 sends export_weights(), the other rank only takes part in its gathers),
     measured interleaved, repeat by repeat;
  5. where a sync's time goes on trainer rank 0: the engine control calls (pause, commit,
     continue), the weight source (export) and the rest (move).
A parity failure does not stop the run: it is marked in table 1 and the exit code is 1.

--smoke: a model of 4 MiB (hidden 256, 2 layers, 4 experts), buckets of 1 MiB (several per sync),
one repeat, every transport and peer: checks the script and the sync paths in well under a minute.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# _bridge_ranks, and the repo root for tests._dist (the rank spawner), in this process and spawned ones
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _bridge_ranks as ranks  # noqa: E402

from tests._dist import run_ranks  # noqa: E402  (the test suite's gloo-rank spawner, shared)

MB = 1 << 20
BIG_MODEL = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1024,
    moe_intermediate_size=512,
    num_experts=8,
)
TRANSPORTS = ("tensor", "disk", "distributed", "reshard")
ENGINE_TP = 2
SMOKE = dict(hidden_size=256, layers=2, experts=4, moe_intermediate_size=128, bucket_mb=1.0, repeats=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default="ep2", help="comma-separated trainer layouts: ep2 (EP=2), pp2 (PP=2)")
    p.add_argument(
        "--transports", default=",".join(TRANSPORTS), help="comma-separated subset of " + ",".join(TRANSPORTS)
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=64.0, help="bridge.bucket_size_mb (the config default)")
    p.add_argument("--hidden-size", type=int, default=BIG_MODEL["hidden_size"])
    p.add_argument("--layers", type=int, default=BIG_MODEL["num_hidden_layers"])
    p.add_argument("--experts", type=int, default=BIG_MODEL["num_experts"])
    p.add_argument("--moe-intermediate-size", type=int, default=BIG_MODEL["moe_intermediate_size"])
    p.add_argument("--atol", type=float, default=1e-4, help="log-prob tolerance of the parity check")
    p.add_argument(
        "--workdir",
        default=None,
        help="checkpoint + disk-transport directory (default: a temp dir under /tmp, removed at the end)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 MiB buckets, 1 repeat (checks the script)")
    args = p.parse_args(argv)
    if args.smoke:  # smoke sizes replace the defaults only: flags given explicitly still win
        for key, value in SMOKE.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    for flag, value, known in (
        ("--layouts", args.layouts, ranks.LAYOUTS),
        ("--transports", args.transports, TRANSPORTS),
    ):
        unknown = set(value.split(",")) - set(known)
        if unknown:
            p.error(f"{flag}: unknown {sorted(unknown)}; use a comma-separated subset of {','.join(known)}")
    return args


def model_overrides(args) -> dict:
    return {
        **BIG_MODEL,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.layers,
        "num_experts": args.experts,
        "moe_intermediate_size": args.moe_intermediate_size,
        "intermediate_size": 2 * args.hidden_size,
        "num_attention_heads": args.hidden_size // 64,
        "num_key_value_heads": max(1, args.hidden_size // 128),
    }


def blocks_for(transports: list[str]) -> list[list[str]]:
    """Transports measured together; the rank-0 funnel is interleaved with the shipped distributed."""
    return [["distributed", "funnel"] if t == "distributed" else [t] for t in TRANSPORTS if t in transports]


# ---- single-process peers ---------------------------------------------------------------------------
def _median_of(run, repeats: int) -> float:
    run()  # warm-up: first touches of fresh memory are start-up, not bandwidth
    return statistics.median(run() for _ in range(repeats))


def peer_memcpy(weights: dict, dest: dict, bucket_bytes: int) -> float:
    from megarl.bridge.buckets import iter_buckets

    start = time.perf_counter()
    for bucket in iter_buckets(weights.items(), bucket_bytes):
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
        offset = 0
        for name, t in bucket:
            n = t.numel() * t.element_size()
            dest[name].view(-1).view(torch.uint8).copy_(flat[offset : offset + n])
            offset += n
    return time.perf_counter() - start


def peer_safetensors(weights: dict, directory: Path) -> float:
    from safetensors.torch import load_file, save_file

    path = directory / "peer.safetensors"
    start = time.perf_counter()
    save_file(weights, str(path), metadata={"format": "pt"})
    loaded = load_file(str(path))
    elapsed = time.perf_counter() - start
    assert len(loaded) == len(weights)
    path.unlink()
    return elapsed


def measure_peers(report: dict, weights: dict, disk_dir: Path, args) -> dict:
    """Peer seconds per transport for one layout's report (same bytes the transports moved)."""
    bucket_bytes, peers = int(args.bucket_mb * MB), {}
    rows = report["rows"]
    if "tensor" in rows:
        dest = {n: torch.empty_like(t) for n, t in weights.items()}
        peers["tensor"] = (
            "memcpy (cat + copy_)",
            _median_of(lambda: peer_memcpy(weights, dest, bucket_bytes), args.repeats),
            None,
        )
    if "disk" in rows:
        peers["disk"] = (
            "safetensors save+load",
            _median_of(lambda: peer_safetensors(weights, disk_dir), args.repeats),
            None,
        )
    buckets = messages = None
    world = 0
    if "distributed" in rows:  # 1 sender -> the engine's ranks
        buckets = [n for per_rank in report["buckets"]["distributed"] for n in per_rank]
        world = 1 + ENGINE_TP
    if "reshard" in rows:  # the 2 trainer ranks -> the engine's ranks
        plan = report["plan"]
        firsts = [sum(plan["engine_sizes"][:e]) for e in range(len(plan["engine_sizes"]))]
        messages = [(src, 2 + firsts[e] + dst, tag, n) for src, e, dst, tag, n in plan["messages"]]
        world = max(world, 2 + sum(plan["engine_sizes"]))
    if world:  # both gloo peers in one spawn of the ranks, one after the other
        seconds = run_ranks(ranks.gloo_peers, world, buckets, messages, args.repeats, ENGINE_TP)[0]
        if buckets is not None:
            peers["distributed"] = (
                f"gloo broadcast, {len(buckets)} buckets, 1->{ENGINE_TP}",
                *seconds["distributed"],
            )
        if messages is not None:
            peers["reshard"] = (f"gloo isend/irecv, {len(messages)} messages, 2->{ENGINE_TP}", *seconds["reshard"])
    return {name: peers[name] for name in TRANSPORTS if name in peers}  # table order


# ---- tables -----------------------------------------------------------------------------------------
LABEL = {"ep2": "EP=2", "pp2": "PP=2"}


def _secs(xs) -> str:
    return ", ".join(f"{x:.3f}" for x in xs)


def _median(xs) -> float:
    return statistics.median(xs)


def table_sync(reports, gb: float, mib: float, repeats: int, atol: float) -> None:
    print(f"\n### 1. Sync time and parity (model {mib:.1f} MiB; median of {repeats})\n")
    print("| trainer | transport | sync s | runs | GB/s | warm-up s | max log-prob err |")
    print("|---|---|---|---|---|---|---|")
    for rep in reports:
        for name in [n for n in TRANSPORTS if n in rep["rows"]]:
            r = rep["rows"][name]
            med = _median(r["times"])
            worst = max(e for e in r["errors"] + [r["warmup_err"]] if e is not None)
            print(
                f"| {LABEL[rep['layout']]} | {name} | {med:.3f} | {_secs(r['times'])} | {gb / med:.2f} | "
                f"{r['warmup_s']:.3f} | {worst:.1e}{'' if worst <= atol else ' FAILED'} |"
            )


def table_peers(reports, peers, gb: float) -> list[str]:
    print("\n### 2. Against raw peers on the same bytes (ratio = peer s / transport s)\n")
    print(
        "| trainer | transport | transport s | peer | peer s | peer GB/s | ratio | peer s, fresh buffers + pack "
        "copy | ratio, fresh |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for rep, layout_peers in zip(reports, peers):
        for name, (what, seconds, fresh) in layout_peers.items():
            med = _median(rep["rows"][name]["times"])
            ratios.append(f"{LABEL[rep['layout']]} {name} {seconds / med:.2f}")
            fresh_cells = f"{fresh:.3f} | {fresh / med:.2f}" if fresh is not None else "– | –"
            print(
                f"| {LABEL[rep['layout']]} | {name} | {med:.3f} | {what} | {seconds:.3f} | {gb / seconds:.2f} | "
                f"{seconds / med:.2f} | {fresh_cells} |"
            )
    return ratios


def table_bytes(reports, mib: float) -> None:
    print(f"\n### 3. Bytes per rollout rank and bytes moved (model {mib:.1f} MiB, engine tp={ENGINE_TP})\n")
    print(
        "| trainer | transport | sent by trainer rank 0 / 1 MiB | received by rollout rank 0 / 1 MiB | "
        "total moved MiB | x model |"
    )
    print("|---|---|---|---|---|---|")
    for rep in reports:
        layout = LABEL[rep["layout"]]
        if "distributed" in rep["buckets"]:
            sent = [sum(b) / MB for b in rep["buckets"]["distributed"]]
            each = sum(sent)  # every engine rank receives every bucket
            print(
                f"| {layout} | distributed | {sent[0]:.1f} / {sent[1]:.1f} (each to {ENGINE_TP} ranks) | "
                f"{each:.1f} / {each:.1f} | {each * ENGINE_TP:.1f} | {each * ENGINE_TP / mib:.2f} |"
            )
        if "plan" in rep:
            plan = rep["plan"]
            sent = [plan["sent"][r] / MB for r in range(2)]
            got = [plan["received"][f"0/{r}"] / MB for r in range(ENGINE_TP)]
            total = plan["payload_total"] / MB
            print(
                f"| {layout} | reshard | {sent[0]:.1f} / {sent[1]:.1f} | {got[0]:.1f} / {got[1]:.1f} | "
                f"{total:.1f} | {total / mib:.2f} |"
            )


def table_senders(reports, gb: float) -> list[str]:
    print("\n### 4. distributed: every EP owner / PP stage sends (shipped) vs one sender (rank-0 funnel)\n")
    print("| trainer | senders | sync s | runs | GB/s | funnel s / shipped s |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for rep in [r for r in reports if "funnel" in r["rows"]]:
        layout, rows = LABEL[rep["layout"]], rep["rows"]
        shipped, single = _median(rows["distributed"]["times"]), _median(rows["funnel"]["times"])
        owners = sum(1 for b in rep["buckets"]["distributed"] if b)
        ratios.append(f"{layout} {single / shipped:.2f}")
        print(
            f"| {layout} | {owners} (shipped) | {shipped:.3f} | {_secs(rows['distributed']['times'])} | "
            f"{gb / shipped:.2f} | |"
        )
        print(
            f"| {layout} | 1 (rank 0, export_weights) | {single:.3f} | {_secs(rows['funnel']['times'])} | "
            f"{gb / single:.2f} | {single / shipped:.2f} |"
        )
    return ratios


def table_phases(reports) -> None:
    print("\n### 5. Where a sync's time goes on trainer rank 0 (medians, seconds)\n")
    print(
        "export = inside the weight source (gathers, PP broadcasts, HF conversion, piece fetches); "
        "move = the rest of the data phase (pack, lock, send, the engines' receive and stage), "
        "less what overlaps with export\n"
    )
    print("| trainer | transport | sync | pause | export | move | commit | continue |")
    print("|---|---|---|---|---|---|---|---|")
    for rep in reports:
        for name in [n for n in (*TRANSPORTS, "funnel") if n in rep["rows"]]:
            phases = rep["rows"][name]["phases"]
            med = {k: _median(p.get(k, 0.0) for p in phases) for k in ("total", *ranks.PHASES)}
            move = _median(p["total"] - sum(p.get(k, 0.0) for k in ranks.PHASES) for p in phases)
            print(
                f"| {LABEL[rep['layout']]} | {name} | {med['total']:.3f} | {med['pause']:.3f} | "
                f"{med['export']:.3f} | {move:.3f} | {med['commit']:.3f} | {med['resume']:.3f} |"
            )


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    from megarl.models.tiny import build_tiny_checkpoint
    from megarl.rollout.fleet.server_process import RolloutServerProcess

    wall = time.perf_counter()
    load_before = os.getloadavg()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="megarl-bench-bridge-"))
    reports, peers = [], []
    try:
        model_dir = build_tiny_checkpoint(workdir / "model", seed=0, **model_overrides(args))
        weights = load_file(str(model_dir / "model.safetensors"))
        model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        print(
            f"model: {len(weights)} tensors, {model_bytes / MB:.1f} MiB fp32; engine tp={ENGINE_TP}; "
            f"trainer layouts {args.layouts}; bucket {args.bucket_mb:g} MiB; {os.cpu_count()} cores"
        )
        disk_dir = workdir / "sync"
        disk_dir.mkdir(exist_ok=True)
        blocks = blocks_for(args.transports.split(","))
        # the disk transport's directory is the only one the server may load weights from, as the
        # trainer's runtime starts its engines (weight_dirs = the run's weights directory)
        server_args = ("--tp", str(ENGINE_TP), "--weight-dirs", str(disk_dir))
        with RolloutServerProcess(model_dir, torch_threads=1, seed=0, extra_args=server_args) as server:
            for layout in args.layouts.split(","):
                t0 = time.perf_counter()
                report = run_ranks(
                    ranks.trainer_rank,
                    2,
                    model_dir,
                    server.url,
                    layout,
                    blocks,
                    args.repeats,
                    int(args.bucket_mb * MB),
                    disk_dir,
                    args.atol,
                )[0]
                t1 = time.perf_counter()
                peers.append(measure_peers(report, weights, disk_dir, args))
                print(
                    f"{LABEL[layout]}: trainer run {t1 - t0:.0f} s, peers {time.perf_counter() - t1:.0f} s; "
                    f"stale engine before the first sync: log-prob error {report['stale_err']:.2e} "
                    f"(> atol {args.atol:g}, so the check catches a sync that delivered nothing)"
                )
                reports.append(report)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    load_after = os.getloadavg()
    gb, mib = model_bytes / 1e9, model_bytes / MB
    table_sync(reports, gb, mib, args.repeats, args.atol)
    peer_ratios = table_peers(reports, peers, gb)
    table_bytes(reports, mib)
    funnel_ratios = table_senders(reports, gb)
    table_phases(reports)
    syncs = "; ".join(
        f"{LABEL[r['layout']]} "
        + ", ".join(f"{n} {_median(r['rows'][n]['times']):.3f} s" for n in TRANSPORTS if n in r["rows"])
        for r in reports
    )
    print(
        f"\nsummary: sync {syncs}; peer/transport {', '.join(peer_ratios)}; funnel/shipped "
        f"{', '.join(funnel_ratios) or '-'}; load average (1 min) {load_before[0]:.2f} -> {load_after[0]:.2f} on "
        f"{os.cpu_count()} cores; wall {time.perf_counter() - wall:.0f} s"
    )
    failures = [f for r in reports for f in r["failures"]]
    if failures:
        print("\nPARITY FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
