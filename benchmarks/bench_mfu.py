"""MFU of the Megatron engine's training step and log-prob pass, against a plain Hugging Face peer.

    .venv/bin/python benchmarks/bench_mfu.py [--threads 1] [--steps 3] [--model mid|moe] [--rows 8] [--seq 512]

A model large enough that GEMMs dominate the step (default `mid`: a dense Qwen2 of 52M parameters,
hidden 1024, 4 layers, 16 heads / 4 KV heads, intermediate 2048, vocab 8192, random init; `moe`: a
Qwen3-MoE of the same width, 16 experts top-4), `--rows` x `--seq` tokens, no padding. Timed, as in
bench_engine.py (whose helpers this imports): megarl's `MegatronEngine.train_mini_batch` (forward,
log-probs, backward, distributed-optimizer Adam step) against HF transformers + torch.optim.AdamW
doing the same work on the same weights and tokens, and the forward log-prob pass
(`compute_log_prob` vs a no-grad HF forward + log_softmax/gather). Both sides live in one process
(one rank) and are timed alternately; each number is the median of `--steps` after one warm-up.

Achieved FLOP/s = model FLOPs (megarl.perf.flops: train_flops / forward_flops over the real token
counts; model FLOPs, so the backward is 2x the forward and nothing is credited for overheads) /
step time. MFU = that / the device's peak (megarl.perf.peak.device_peak_flops):

- CPU (fp32): this host's own GEMM throughput at `--threads` threads, measured once and cached
  (the larger of the threaded best and threads x the single-thread best; printed with its parts).
- CUDA (bf16, one GPU, nccl): the datasheet table's dense bf16 peak for the GPU's name. The same
  command; `--rows` defaults to 32 there. Written but not yet run on a GPU.

It prints the per-pass table as markdown, ready for benchmarks/RESULTS.md.

--smoke: the chosen model at hidden 64 (4 heads, vocab 512; the MoE with 4 experts top-2), 2 x 32
tokens, one timed step: checks the script, the FLOPs and the peak in seconds.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import hf_peer, interleaved, make_engine, make_rows, pg_loss  # noqa: E402

_WIDTH = dict(
    vocab_size=8192,
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)
MODELS = {
    # (tiny preset to build from, overrides, one-line description)
    "mid": (
        "tiny-qwen2",
        dict(_WIDTH, intermediate_size=2048),
        "dense Qwen2, hidden 1024, 4 layers, 16 heads x 64 (4 KV), intermediate 2048, vocab 8192",
    ),
    "moe": (
        "tiny-qwen3-moe",
        dict(
            _WIDTH,
            head_dim=64,
            intermediate_size=2048,
            moe_intermediate_size=512,
            num_experts=16,
            num_experts_per_tok=4,
        ),
        "Qwen3-MoE, hidden 1024, 4 layers, 16 heads x 64 (4 KV), 16 experts top-4 x 512, vocab 8192",
    ),
}


# --smoke: the model's widths (only the keys it has) and the run's sizes; flags given explicitly still win
SMOKE_WIDTH = dict(
    vocab_size=512,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
)
SMOKE = dict(rows=2, seq=32, steps=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU); the CPU peak is for this count")
    p.add_argument("--steps", type=int, default=3, help="timed steps per measurement (median)")
    p.add_argument("--model", choices=sorted(MODELS), default="mid")
    p.add_argument("--rows", type=int, default=None, help="sequences per step (default 8 on CPU, 32 on CUDA)")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence (prompt = the first quarter)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--workdir", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny widths, 2 x 32 tokens, 1 step (checks the script)")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    return args


def init_dist(device: str, work: Path) -> None:
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)
    store = dist.FileStore(str(work / "store"), 1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1)


def peak_of(device: str, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s of one device, how it was obtained)."""
    from megarl.perf import peak

    flops = peak.device_peak_flops(device, dtype)
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        return flops, f"{name}: datasheet dense {dtype} ({peak.gpu_table_entry(name)}), {flops / 1e12:,.1f} TFLOP/s"
    entry = peak.cpu_peak_record(dtype)
    parts = ""
    if entry:
        parts = (
            f" = max(threaded {entry['threaded_flops'] / 1e9:.0f}, {entry['threads']} x single-thread "
            f"{entry['single_thread_flops'] / 1e9:.0f}) GFLOP/s, measured {entry.get('measured_at', '?')}"
        )
    return (
        flops,
        f"this CPU's {dtype} GEMM peak at {torch.get_num_threads()} thread(s): {flops / 1e9:.0f} GFLOP/s{parts}",
    )


def synced(fn, device: str):
    """`fn` followed by a device sync, so a timer around it measures the work, not the launch."""
    if device != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize()

    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False; use --device cpu")
    rows_n = args.rows or (32 if device == "cuda" else 8)
    precision, dtype = ("bf16", torch.bfloat16) if device == "cuda" else ("fp32", torch.float32)
    torch.set_num_threads(args.threads)

    from megarl.models.tiny import build_tiny_checkpoint
    from megarl.perf import forward_flops, mfu, param_counts, train_flops

    preset, overrides, desc = MODELS[args.model]
    if args.smoke:
        overrides = {**overrides, **{k: v for k, v in SMOKE_WIDTH.items() if k in overrides or k == "head_dim"}}
        desc = f"{desc}; --smoke widths {overrides}"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_mfu_"))
    if args.workdir is None:  # a temporary work directory goes at exit
        atexit.register(shutil.rmtree, work, True)
    t0 = time.perf_counter()
    model_path = str(build_tiny_checkpoint(work / args.model, seed=0, preset=preset, **overrides))
    config = json.loads((Path(model_path) / "config.json").read_text())
    init_dist(device, work)
    peak, peak_desc = peak_of(device, precision)

    lengths = [args.seq] * rows_n
    rows = make_rows(lengths, config["vocab_size"], seed=1)
    tokens = sum(lengths)
    f_train, f_fwd = train_flops(config, lengths), forward_flops(config, lengths)
    total, active = param_counts(config)
    load0 = os.getloadavg()[0]
    print(f"model: {args.model} ({desc}); {total / 1e6:.1f}M parameters ({active / 1e6:.1f}M active)")
    print(
        f"device: {device}, {precision}, {args.threads} torch thread(s); {rows_n} x {args.seq} = {tokens} tokens/step; "
        f"median of {args.steps} steps after 1 warm-up, alternating"
    )
    print(f"peak: {peak_desc}")
    print(f"FLOPs/step (megarl.perf.flops): train {f_train / 1e12:.3f} T, forward {f_fwd / 1e12:.3f} T")

    peer_step, peer_forward = hf_peer(model_path, rows, device=device, dtype=dtype)
    engine = make_engine(model_path, packed=True, micro_batch_size=rows_n, precision=precision)
    head = engine.logprob_head(1.0, entropy_grad=False)  # as update_actor runs it without entropy_coeff
    t_train, t_peer_train = interleaved(
        synced(lambda: engine.train_mini_batch(rows, pg_loss, head=head), device), synced(peer_step, device), args.steps
    )
    engine = head = None  # free the training engine (weights, Adam state) before building the next
    ref = make_engine(model_path, packed=True, micro_batch_size=rows_n, train=False, precision=precision)
    t_fwd, t_peer_fwd = interleaved(
        synced(lambda: ref.compute_log_prob(rows), device), synced(peer_forward, device), args.steps
    )
    load1 = os.getloadavg()[0]

    print(f"\nload average (1 min) {load0:.1f} before, {load1:.1f} after; run took {time.perf_counter() - t0:.0f} s\n")
    print("| model | pass | side | s/step | tokens/s | TFLOP/s | MFU |\n|---|---|---|---|---|---|---|")
    for name, flops, ours, theirs in (("train", f_train, t_train, t_peer_train), ("forward", f_fwd, t_fwd, t_peer_fwd)):
        for side, sec in (("megarl", ours), ("HF peer", theirs)):
            print(
                f"| {args.model} | {name} | {side} | {sec:.2f} | {tokens / sec:,.0f} | "
                f"{flops / sec / 1e12:.3f} | **{mfu(flops, sec, 1, peak):.1%}** |"
            )
        print(f"| {args.model} | {name} | megarl / peer | | **{theirs / ours:.2f}x** | | |")
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
