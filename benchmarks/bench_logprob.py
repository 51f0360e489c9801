"""The engine's chunked log-prob / entropy head against the full-vocabulary computation it replaced.

    .venv/bin/python benchmarks/bench_logprob.py [--tokens 8192] [--vocab 151936] [--threads 2] [--rounds 2]
    .venv/bin/python benchmarks/bench_logprob.py --smoke    # 64 tokens x 4096, chunks of 16 tokens

The head's input is what the model's output layer hands it: fp32 logits [tokens, vocab] (random,
scale 2; what made them does not change the head's cost). Three passes, each as the engine runs it:
`forward` (compute_log_prob: no graph, log-prob and entropy), `train` (update_actor without an
entropy loss: d log-prob / d logits, entropy a detached metric) and `train+entropy`
(entropy_coeff != 0: both gradients). The peer, `full`, is the computation the engine ran before:
max, shifted logits, exp and their products over the whole [tokens, vocab] at once, with autograd
keeping what it needs; `chunked` is megarl/engine/megatron/logprob.py.

Memory: every (variant, pass) runs in a fresh process, which allocates the logits (and labels,
loss weights), then reads its resident set (psutil) as the baseline, runs the pass once and reads
the kernel's peak resident set (getrusage ru_maxrss). The table gives peak - baseline (what the
pass added: its intermediates, autograd's saved tensors and the logits' gradient) and the
process's peak including the logits. torch's CPU allocator returns large blocks to the OS on
free, so RSS follows what is live. The last line's ratio is the largest chunked / full ratio of
peak memory including the logits over the three passes (the logits exist either way, so this is
the conservative one). Time: the pass's wall time in the same process; variants alternate over
--rounds rounds and the minimum is kept. Before timing, chunked and full are checked equal
(log-prob, entropy, gradients within 1e-6 relative, on the first 256 tokens); a mismatch exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.engine.megatron.logprob import chunk_tokens, vocab_parallel_logprob_entropy  # noqa: E402

PASSES = ("forward", "train", "train+entropy")
VARIANTS = ("full", "chunked")


def full_head(logits, labels, entropy_grad):
    """The unchunked computation at TP=1: log p(label) and entropy, graph through [tokens, vocab]."""
    x = logits.float()
    shifted = x - x.detach().max(dim=-1).values.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    log_z = sum_exp.log()
    log_prob = shifted.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_z
    if entropy_grad:
        return log_prob, log_z - (exp * shifted).sum(dim=-1) / sum_exp
    with torch.no_grad():
        return log_prob, log_z - (exp * shifted).sum(dim=-1) / sum_exp


def run_pass(variant, kind, logits, labels, w_lp, w_ent, chunk):
    entropy_grad = kind == "train+entropy"
    if variant == "full":
        lp, ent = full_head(logits, labels, entropy_grad)
    else:
        # as the engine's head runs it: d/d logits written over the logits
        lp, ent = vocab_parallel_logprob_entropy(
            logits, labels, entropy_grad=entropy_grad, chunk=chunk, overwrite_logits=True
        )
    if kind != "forward":
        loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0)
        loss.backward()
    return lp.detach(), ent.detach()


def inputs(tokens, vocab, kind, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, vocab, generator=gen).mul_(2.0)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    w_lp, w_ent = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)
    return logits.requires_grad_(kind != "forward"), labels, w_lp, w_ent


def worker(args) -> None:
    """One (variant, pass) in this process: prints {"base", "peak", "seconds"} as JSON."""
    import psutil

    torch.set_num_threads(args.threads)
    logits, labels, w_lp, w_ent = inputs(args.tokens, args.vocab, args.kind)
    base = psutil.Process().memory_info().rss
    start = time.perf_counter()
    with torch.set_grad_enabled(args.kind != "forward"):
        run_pass(args.variant, args.kind, logits, labels, w_lp, w_ent, args.chunk)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "peak": peak, "seconds": seconds}))


def check_equal(vocab, chunk) -> float:
    """Largest relative difference of chunked vs full over every pass's outputs and gradients."""
    worst = 0.0
    for kind in PASSES:
        out = {}
        for variant in VARIANTS:
            logits, labels, w_lp, w_ent = inputs(256, vocab, kind, seed=1)
            with torch.set_grad_enabled(kind != "forward"):
                lp, ent = run_pass(variant, kind, logits, labels, w_lp, w_ent, chunk or 7)
            out[variant] = [lp, ent] + ([logits.grad] if kind != "forward" else [])
        for a, b in zip(out["chunked"], out["full"]):
            worst = max(worst, float(((a - b).abs() / b.abs().clamp(min=1)).max()))
    return worst


def measure(args, variant, kind) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--kind", kind]
    cmd += ["--tokens", str(args.tokens), "--vocab", str(args.vocab), "--threads", str(args.threads)]
    cmd += ["--chunk", str(args.chunk)] if args.chunk else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chunk", type=int, default=0, help="tokens per chunk (0: the engine's default)")
    p.add_argument(
        "--variants",
        default="full,chunked",
        help="chunked alone: sizes where the full computation does not fit in memory",
    )
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=PASSES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.tokens, args.vocab, args.rounds, args.chunk, args.threads = 64, 4096, 1, 16, 1
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    torch.set_num_threads(args.threads)
    worst = check_equal(args.vocab, args.chunk)
    print(f"chunked vs full, largest relative difference (log-prob, entropy, gradients): {worst:.2e}")
    if worst > 1e-6:
        print("FAILED: chunked differs from full by more than 1e-6")
        return 1
    chunk = args.chunk or chunk_tokens(args.vocab)
    print(
        f"{args.tokens} tokens x vocab {args.vocab}, fp32 logits {args.tokens * args.vocab * 4 / 2**30:.2f} GiB, "
        f"chunks of {chunk} tokens, {args.threads} threads, best of {args.rounds} rounds\n"
    )
    print("| pass | variant | added peak MiB | peak with logits MiB | s |")
    print("|---|---|---|---|---|")
    results = {}
    for kind in PASSES:
        runs = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                runs[variant].append(measure(args, variant, kind))
        for variant in variants:
            peak = max(r["peak"] for r in runs[variant])
            added = max(r["peak"] - r["base"] for r in runs[variant])
            seconds = min(r["seconds"] for r in runs[variant])
            results[kind, variant] = (added, peak, seconds)
            print(f"| {kind} | {variant} | {added / 2**20:,.0f} | {peak / 2**20:,.0f} | {seconds:.3f} |")
    if variants != list(VARIANTS):
        return 0
    print("\n| pass | added peak chunked / full | peak with logits chunked / full | time chunked / full |")
    print("|---|---|---|---|")
    ratios = []
    for kind in PASSES:
        (fa, fp, fs), (ca, cp, cs) = results[kind, "full"], results[kind, "chunked"]
        ratios.append(cp / fp)
        print(f"| {kind} | {ca / fa:.3f} | {cp / fp:.3f} | {cs / fs:.2f} |")
    print(f"peak memory ratio {max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
