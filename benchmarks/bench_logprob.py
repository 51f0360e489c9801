"""The engine's fused log-prob / entropy head against the output layer + full-vocabulary computation.

    nice -n 10 .venv/bin/python benchmarks/bench_logprob.py [--tokens 8192] [--hidden 1024] [--vocab 151936]
        [--threads 2] [--rounds 2] [--cap-gib G] [--device cpu|cuda]
    .venv/bin/python benchmarks/bench_logprob.py --smoke    # 64 tokens, hidden 64, vocab 4096, chunks of 16

The head's input is what the model hands it: the final norm's hidden states [tokens, hidden] and
the output layer's weight [vocab, hidden] (fp32, random: hidden ~ N(0, 1), weight scaled so the
logits have std 2; hidden 1024 and vocab 151,936 are Qwen3-0.6B's). `full` is what the engine
ran before: the output layer's GEMM, logits = hidden @ weight^T, then max, shifted logits, exp
and their products over the whole [tokens, vocab] at once, autograd keeping what it needs. The
fused variants are megarl/engine/megatron/logprob.py's fused_linear_logprob_entropy, which makes
the logits one chunk of tokens at a time, in its two modes (actor.logits_memory):
`fused-recompute` makes them again in backward (4 GEMMs in training, least memory) and
`fused-keep` keeps them from forward, [tokens, vocab] in the model's dtype (here fp32), for
backward (3 GEMMs, as full). Three passes, each as the engine runs it: `forward`
(compute_log_prob: no graph, log-prob and entropy; both fused modes run alike, keeping nothing),
`train` (update_actor without an entropy loss: d log-prob / d hidden and d weight, entropy a
detached metric) and `train+entropy` (entropy_coeff != 0: both gradients).

Memory: every (variant, pass) runs in a fresh process, which allocates the inputs, reads its
resident set (psutil) as the baseline, runs the pass once and reads the kernel's peak resident
set (getrusage ru_maxrss). The table gives peak - baseline ("added": intermediates, autograd's
saved tensors, the gradients) and the process's peak including the inputs. Each child runs
under a data-segment limit (RLIMIT_DATA, --cap-gib; default 70% of MemAvailable when the bench
starts), so a pass that does not fit gets an allocation error instead of waking the kernel's OOM
killer; it is reported as "needs more than X GiB (allocation refused at Y GiB RSS)" and not run
again. On a GPU (--device cuda) the peak is torch's max_memory_allocated and the cap a memory
fraction. Per fused mode, the ratio table gives fused / full peak memory and time per pass, and
a line its time ratios. The last line, `peak memory ratio R`, is the largest fused / full ratio of
peak memory including the inputs over the three passes, for the mode the engine's default
(logits_memory auto, logprob.keeps_logits) picks at these tokens and vocabulary in fp32: at the
default 8,192 tokens x 151,936 the kept logits would be 4.6 GiB, over auto's 2 GiB, so R is
fused-recompute's; at 2,048 tokens (1.16 GiB) it is fused-keep's. Where full was refused its peak
is a lower bound (the RSS it had reached), so the ratio is an upper bound, which a line before
says. Time: the pass's wall time; variants alternate over --rounds rounds and the minimum is
kept; compared only where both fit. Before anything is measured, each fused mode (in its
measured chunks) and full are checked equal on 256 tokens (log-prob, entropy, d hidden, d weight
within 1e-6 of each tensor's largest entry), and the two modes bit for bit; a mismatch exits 1.
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

from megarl.engine.megatron.logprob import (  # noqa: E402
    chunk_tokens,
    fused_linear_logprob_entropy,
    keeps_logits,
)

PASSES = ("forward", "train", "train+entropy")
VARIANTS = ("full", "fused-recompute", "fused-keep")
FUSED = VARIANTS[1:]
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
        keep = variant == "fused-keep"
        lp, ent = fused_linear_logprob_entropy(
            hidden, weight, labels, keep_logits=keep, entropy_grad=entropy_grad, chunk=chunk
        )
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


def check_equal(args) -> tuple[float, bool]:
    """(largest difference of either fused mode vs full over every pass's outputs and gradients,
    relative to each tensor's largest entry; whether the two fused modes agree bit for bit)."""
    worst, same = 0.0, True
    for kind in PASSES:
        out = {}
        for variant in VARIANTS:
            hidden, weight, labels, w_lp, w_ent = inputs(256, args.hidden, args.vocab, kind, args.device, seed=1)
            with torch.set_grad_enabled(kind != "forward"):
                lp, ent = run_pass(variant, kind, hidden, weight, labels, w_lp, w_ent, args.chunk or None)
            out[variant] = [lp, ent] + ([hidden.grad, weight.grad] if kind != "forward" else [])
        for variant in FUSED:
            worst = max([worst] + [_close_norm(a, b) for a, b in zip(out[variant], out["full"])])
        same &= all(torch.equal(a, b) for a, b in zip(out["fused-recompute"], out["fused-keep"]))
    return worst, same


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


def print_ratios(results, r_variant: str) -> None:
    """Per fused mode and pass: fused / full added and total peak memory, and time; then each
    mode's time ratios, and last the peak memory ratio R of `r_variant`."""
    print("\n| pass | variant | added peak fused / full | peak with inputs fused / full | time fused / full |")
    print("|---|---|---|---|---|")
    ratios, times, bounded = {v: [] for v in FUSED}, {v: [] for v in FUSED}, False
    for variant in FUSED:
        for kind in PASSES:
            (fa, fp, fs), (ca, cp, cs) = results[kind, "full"], results[kind, variant]
            if cs is None:
                raise SystemExit(f"{variant} was refused memory in the {kind} pass: raise --cap-gib")
            refused = fs is None
            bounded |= refused
            ratios[variant].append(cp / fp)
            times[variant].append("-" if refused else f"{cs / fs:.2f}x")
            le = "<= " if refused else ""
            print(f"| {kind} | {variant} | {le}{ca / fa:.3f} | {le}{cp / fp:.3f} | {times[variant][-1]} |")
    if bounded:
        print("full was refused memory in some pass: its peak there is a lower bound, the ratios upper bounds")
    for variant in FUSED:
        print(f"time ratio {variant} / full ({' / '.join(PASSES)}): {' / '.join(times[variant])}")
    print(f"peak memory ratio {max(ratios[r_variant]):.3f} ({r_variant}, what logits_memory auto picks here)")


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
    p.add_argument("--variants", default=",".join(VARIANTS), help="without full or a fused mode: no ratios")
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
    worst, same = check_equal(args)
    print(
        f"fused vs full, largest difference / tensor's largest entry (log-prob, entropy, d hidden, d weight): "
        f"{worst:.2e}; fused-keep vs fused-recompute: {'bit-identical' if same else 'DIFFERENT'}"
    )
    if worst > 1e-6 or not same:
        print("FAILED: a fused mode differs from full by more than 1e-6, or the two modes differ")
        return 1
    chunk = args.chunk or chunk_tokens(args.vocab)
    r_variant = "fused-keep" if keeps_logits("auto", args.tokens, args.vocab, torch.float32) else "fused-recompute"
    print(
        f"{args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab} on {args.device}: fp32 logits would be "
        f"{args.tokens * args.vocab * 4 / 2**30:.2f} GiB (logits_memory auto: {r_variant.split('-')[1]}), "
        f"the weight {args.vocab * args.hidden * 4 / 2**30:.2f} GiB; chunks of {chunk} tokens, {args.threads} "
        f"threads, best of {args.rounds} rounds, each pass capped at {args.cap_gib:.1f} GiB\n"
    )
    results = run_table(args, variants)
    if variants == list(VARIANTS):
        print_ratios(results, r_variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
