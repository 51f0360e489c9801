"""The engine's fused log-prob / entropy head against the output layer + full-vocabulary computation.

    nice -n 10 .venv/bin/python benchmarks/bench_logprob.py [--tokens 8192] [--hidden 1024] [--vocab 151936]
        [--threads 2] [--rounds 2] [--cap-gib G] [--device cpu|cuda]
    .venv/bin/python benchmarks/bench_logprob.py --smoke    # 64 tokens, hidden 64, vocab 4096, chunks of 16

The head's input is what the model hands it: the final norm's hidden states [tokens, hidden] and
the output layer's weight [vocab, hidden] (fp32, random: hidden ~ N(0, 1), weight scaled so the
logits have std 2; hidden 1024 and vocab 151,936 are Qwen3-0.6B's). `full` is what the engine
ran before: the output layer's GEMM, logits = hidden @ weight^T, then max, shifted logits, exp
and their products over the whole [tokens, vocab] at once, autograd keeping what it needs;
`chunked` is megarl/engine/megatron/logprob.py's fused_linear_logprob_entropy, which makes the
logits one chunk of tokens at a time (and again in backward). Three passes, each as the engine
runs it: `forward` (compute_log_prob: no graph, log-prob and entropy), `train` (update_actor
without an entropy loss: d log-prob / d hidden and d weight, entropy a detached metric) and
`train+entropy` (entropy_coeff != 0: both gradients).

Memory: every (variant, pass) runs in a fresh process, which allocates the inputs, reads its
resident set (psutil) as the baseline, runs the pass once and reads the kernel's peak resident
set (getrusage ru_maxrss). The table gives peak - baseline ("added": intermediates, autograd's
saved tensors, the gradients) and the process's peak including the inputs. Each child runs
under a data-segment limit (RLIMIT_DATA, --cap-gib; default 70% of MemAvailable when the bench
starts), so a pass that does not fit gets an allocation error instead of waking the kernel's OOM
killer; it is reported as "needs more than X GiB (allocation refused at Y GiB RSS)" and not run
again. On a GPU (--device cuda) the peak is torch's max_memory_allocated and the cap a memory
fraction. The last line's ratio is the largest chunked / full ratio of peak memory including the
inputs over the three passes; where full was refused its peak is a lower bound (the RSS it had
reached), so the ratio is an upper bound, which the line before says. Time: the pass's wall
time; variants alternate over --rounds rounds and the minimum is kept; compared only where both
fit. Before anything is measured, chunked (in its measured chunks) and full are checked equal on
256 tokens (log-prob, entropy, d hidden, d weight within 1e-6 of each tensor's largest entry); a
mismatch exits 1.
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

from megarl.engine.megatron.logprob import chunk_tokens, fused_linear_logprob_entropy  # noqa: E402

PASSES = ("forward", "train", "train+entropy")
VARIANTS = ("full", "chunked")
CAP_FRACTION = 0.7  # of MemAvailable: the default cap on each child's data segment


def full_head(hidden, weight, labels, entropy_grad):
    """The unfused computation at TP=1: logits, then log p(label) and entropy over [tokens, vocab]."""
    x = (hidden @ weight.t()).float()
    shifted = x - x.detach().max(dim=-1).values.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    log_z = sum_exp.log()
    log_prob = shifted.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_z
    if entropy_grad:
        return log_prob, log_z - (exp * shifted).sum(dim=-1) / sum_exp
    with torch.no_grad():
        return log_prob, log_z - (exp * shifted).sum(dim=-1) / sum_exp


def run_pass(variant, kind, hidden, weight, labels, w_lp, w_ent, chunk):
    entropy_grad = kind == "train+entropy"
    if variant == "full":
        lp, ent = full_head(hidden, weight, labels, entropy_grad)
    else:
        lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, entropy_grad=entropy_grad, chunk=chunk)
    if kind != "forward":
        loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0)
        loss.backward()
    return lp.detach(), ent.detach()


def inputs(tokens, hidden_size, vocab, kind, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen).mul_(2.0 / hidden_size**0.5)  # logits ~ N(0, 4)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    w_lp, w_ent = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)
    out = [t.to(device) for t in (hidden, weight, labels, w_lp, w_ent)]
    for t in out[:2]:
        t.requires_grad_(kind != "forward")
    return out


def _refused(err: BaseException) -> bool:
    return isinstance(err, MemoryError) or "can't allocate memory" in str(err) or "out of memory" in str(err)


def worker(args) -> None:
    """One (variant, pass) in this process: prints {"base", "peak", "seconds"} or {"refused", "peak"} as JSON."""
    import psutil

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / torch.cuda.mem_get_info()[1]))
    tensors = inputs(args.tokens, args.hidden, args.vocab, args.kind, args.device)
    base = torch.cuda.memory_allocated() if cuda else psutil.Process().memory_info().rss
    start = time.perf_counter()
    try:
        with torch.set_grad_enabled(args.kind != "forward"):
            run_pass(args.variant, args.kind, *tensors, args.chunk)
        if cuda:
            torch.cuda.synchronize()
        result = {"base": base, "seconds": time.perf_counter() - start}
    except (RuntimeError, MemoryError) as err:
        if not _refused(err):
            raise
        result = {"refused": True, "base": base}
    result["peak"] = (
        torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    print(json.dumps(result))


def _close_norm(a, b) -> float:
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def check_equal(args) -> float:
    """Largest difference of chunked vs full over every pass's outputs and gradients, relative to
    each tensor's largest entry."""
    worst = 0.0
    for kind in PASSES:
        out = {}
        for variant in VARIANTS:
            hidden, weight, labels, w_lp, w_ent = inputs(256, args.hidden, args.vocab, kind, args.device, seed=1)
            with torch.set_grad_enabled(kind != "forward"):
                lp, ent = run_pass(variant, kind, hidden, weight, labels, w_lp, w_ent, args.chunk or None)
            out[variant] = [lp, ent] + ([hidden.grad, weight.grad] if kind != "forward" else [])
        worst = max([worst] + [_close_norm(a, b) for a, b in zip(out["chunked"], out["full"])])
    return worst


def measure(args, variant, kind) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--kind", kind, "--device", args.device]
    cmd += ["--tokens", str(args.tokens), "--hidden", str(args.hidden), "--vocab", str(args.vocab)]
    cmd += ["--threads", str(args.threads), "--cap-gib", str(args.cap_gib)]
    cmd += ["--chunk", str(args.chunk)] if args.chunk else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cap = int(args.cap_gib * 2**30)

    def limit():  # in the child, before exec: its whole data segment (heap and anonymous mmaps)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    done = subprocess.run(
        cmd, stdout=subprocess.PIPE, text=True, env=env, check=True, preexec_fn=None if args.device == "cuda" else limit
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def run_table(args, variants) -> dict:
    """(pass, variant) -> (added, peak, seconds or None when refused), printing the table."""
    print("| pass | variant | added peak MiB | peak with inputs MiB | s |")
    print("|---|---|---|---|---|")
    results = {}
    for kind in PASSES:
        runs = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                if not any(r.get("refused") for r in runs[variant]):  # refused once: refused again
                    runs[variant].append(measure(args, variant, kind))
        for variant in variants:
            rs = runs[variant]
            peak = max(r["peak"] for r in rs)
            added = max(r["peak"] - r["base"] for r in rs)
            if any(r.get("refused") for r in rs):
                results[kind, variant] = (added, peak, None)
                what = f"needs more than {args.cap_gib:.1f} GiB (allocation refused at {_gib(peak)} GiB RSS)"
                print(f"| {kind} | {variant} | {what} | >= {peak / 2**20:,.0f} | - |")
                continue
            seconds = min(r["seconds"] for r in rs)
            results[kind, variant] = (added, peak, seconds)
            print(f"| {kind} | {variant} | {added / 2**20:,.0f} | {peak / 2**20:,.0f} | {seconds:.3f} |")
    return results


def print_ratios(results) -> None:
    print("\n| pass | added peak chunked / full | peak with inputs chunked / full | time chunked / full |")
    print("|---|---|---|---|")
    ratios, bounded = [], False
    for kind in PASSES:
        (fa, fp, fs), (ca, cp, cs) = results[kind, "full"], results[kind, "chunked"]
        if cs is None:
            raise SystemExit(f"chunked was refused memory in the {kind} pass: raise --cap-gib")
        refused = fs is None
        bounded |= refused
        ratios.append(cp / fp)
        le = "<= " if refused else ""
        print(f"| {kind} | {le}{ca / fa:.3f} | {le}{cp / fp:.3f} | {'-' if refused else f'{cs / fs:.2f}'} |")
    if bounded:
        print("full was refused memory in some pass: its peak there is a lower bound, the ratio an upper bound")
    print(f"peak memory ratio {max(ratios):.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chunk", type=int, default=0, help="tokens per chunk (0: the engine's default)")
    p.add_argument(
        "--cap-gib", type=float, default=0.0, help=f"per-child memory cap (0: {CAP_FRACTION} x MemAvailable)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--variants", default="full,chunked", help="chunked alone: no comparison, no ratio")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=PASSES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.tokens, args.hidden, args.vocab, args.rounds, args.chunk, args.threads = 64, 64, 4096, 1, 16, 1
    if args.cap_gib <= 0:
        total = torch.cuda.mem_get_info()[1] / 2**30 if args.device == "cuda" else mem_available_gib()
        args.cap_gib = CAP_FRACTION * total
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    torch.set_num_threads(args.threads)
    worst = check_equal(args)
    print(
        f"chunked vs full, largest difference / tensor's largest entry (log-prob, entropy, d hidden, d weight): {worst:.2e}"
    )
    if worst > 1e-6:
        print("FAILED: chunked differs from full by more than 1e-6")
        return 1
    chunk = args.chunk or chunk_tokens(args.vocab)
    print(
        f"{args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab} on {args.device}: fp32 logits would be "
        f"{args.tokens * args.vocab * 4 / 2**30:.2f} GiB, the weight {args.vocab * args.hidden * 4 / 2**30:.2f} GiB; "
        f"chunks of {chunk} tokens, {args.threads} threads, best of {args.rounds} rounds, "
        f"each pass capped at {args.cap_gib:.1f} GiB\n"
    )
    results = run_table(args, variants)
    if variants == list(VARIANTS):
        print_ratios(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
