"""bench_rollout.py --mixed: continuous batching vs static batches on long-tail response lengths.

(Imported by bench_rollout.py, whose module doc describes the workload and the paths.)
"""

from __future__ import annotations

import random
import time

import torch


def mixed_rows(prompts: list[list[int]], args) -> tuple[list[list[int]], list[int]]:
    """--prompts x --n rows (the n samples of a prompt adjacent) and each row's exact length."""
    rng = random.Random(1)
    rows = [p for p in prompts for _ in range(args.n)]
    lengths = [
        args.long_tokens if rng.random() < args.long_fraction else rng.randint(args.short_min, args.short_max)
        for _ in rows
    ]
    return rows, lengths


@torch.inference_mode()
def run_hf_static(model, rows, lengths, batch: int):
    """Static batches in order: each runs until its longest row is done (the others' extra steps
    are computed and thrown away); only each row's own tokens are counted."""
    start = time.perf_counter()
    for s in range(0, len(rows), batch):
        chunk, longest = rows[s : s + batch], max(lengths[s : s + batch])
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=longest,
            min_new_tokens=longest,
            use_cache=True,
            pad_token_id=0,
        )
        if out.shape[1] - width != longest:
            raise RuntimeError(f"HF generate made {out.shape[1] - width} tokens, asked for {longest}")
    return time.perf_counter() - start, sum(lengths), None


def run_engine(engine, rows, lengths):
    from megarl.rollout.engine.protocol import GenerationRequest, SamplingParams

    tag = time.monotonic_ns()
    requests = [
        GenerationRequest(
            rid=f"mixed-{tag}-{i}",
            input_ids=p,
            return_logprob=True,
            params=SamplingParams(max_new_tokens=m, temperature=1.0, ignore_eos=True),
        )
        for i, (p, m) in enumerate(zip(rows, lengths))
    ]
    start = time.perf_counter()
    results = [f.result() for f in engine.submit(requests)]
    elapsed = time.perf_counter() - start
    return elapsed, _checked(results, lengths), None


def run_server(url: str, rows, lengths):
    """The production client, one batched /generate with one sampling_params per row."""
    from megarl.rollout.client.client import RolloutClient

    params = [{"max_new_tokens": m, "temperature": 1.0, "ignore_eos": True} for m in lengths]
    with RolloutClient(url, batched=True) as client:
        start = time.perf_counter()
        outputs = client.generate(rows, params, return_logprob=True)
        elapsed = time.perf_counter() - start
    return elapsed, _checked(outputs, lengths), None


def _checked(outputs, lengths) -> int:
    got = [len(o.output_ids) for o in outputs]
    if got != lengths:
        raise RuntimeError("a row did not get exactly its own number of tokens")
    return sum(got)


def _stats(engine_stats_fn, before: dict, repeats: int) -> str:
    after = engine_stats_fn()
    delta = {k: (after.get(k, 0) - before.get(k, 0)) / repeats for k in ("batches", "forward_steps", "joined")}
    return (
        f"{delta['batches']:.0f} batches, {delta['forward_steps']:.0f} forward steps, "
        f"{delta['joined']:.0f} joins per run; max rows {after.get('max_rows', 0)}"
    )


def measure_mixed(model_dir, prompts, args, median_rate) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from megarl.rollout.engine.generation import GenerationEngine
    from megarl.rollout.fleet.server_process import RolloutServerProcess

    rows, lengths = mixed_rows(prompts, args)
    warm_rows, warm_lengths = rows[:2], [2, 2]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    run_hf_static(model, warm_rows, warm_lengths, args.batch_size)
    results = [
        {
            "path": f"HF generate, static batches of {args.batch_size}",
            "params": sum(p.numel() for p in model.parameters()),
            **median_rate(lambda: run_hf_static(model, rows, lengths, args.batch_size), args.repeats),
        }
    ]
    for label, continuous in (
        ("megarl engine in-process, continuous batching", True),
        ("megarl engine in-process, static batches (continuous_batching=False)", False),
    ):
        engine = GenerationEngine(
            str(model_dir), max_batch_size=args.batch_size, seed=0, continuous_batching=continuous
        )
        try:
            run_engine(engine, warm_rows, warm_lengths)
            before = dict(engine.stats)
            row = {"path": label, **median_rate(lambda: run_engine(engine, rows, lengths), args.repeats)}
            row["engine"] = _stats(lambda: dict(engine.stats), before, args.repeats)
            results.append(row)
        finally:
            engine.close()
    with RolloutServerProcess(model_dir, torch_threads=1, max_batch_size=args.batch_size) as server:
        import httpx

        def stats():
            return httpx.get(f"{server.url}/get_server_info", timeout=10).json()["engine_stats"]

        run_server(server.url, warm_rows, warm_lengths)
        before = stats()
        row = {
            "path": "megarl server, RolloutClient (1 batched /generate), continuous batching",
            **median_rate(lambda: run_server(server.url, rows, lengths), args.repeats),
        }
        row["engine"] = _stats(stats, before, args.repeats)
        results.append(row)
    return results


def print_mixed_table(rows, args, load_before, load_after) -> None:
    import os

    print(
        f"\n--mixed: {args.prompts} prompts x n={args.n} rows; lengths: a fraction {args.long_fraction} of "
        f"{args.long_tokens} new tokens, the rest uniform in [{args.short_min}, {args.short_max}]; at most "
        f"{args.batch_size} rows at once; 1 torch thread; median of {args.repeats}; load average (1 min) before "
        f"{load_before[0]:.2f}, after {load_after[0]:.2f} on {os.cpu_count()} cores"
    )
    print_rate_table(rows, speedup=True)


def print_rate_table(rows, speedup: bool) -> None:
    """One markdown row per measurement, with its ratio against the HF peer of the same model:
    `speedup` (this / peer, higher is faster) or the older peer / this."""
    ratio = "speedup vs HF" if speedup else "ratio peer/this"
    print(f"\n| model (params) | path | tokens | seconds (median) | runs | tokens/s | {ratio} | engine |")
    print("|---|---|---|---|---|---|---|---|")
    peers = {r["model"]: r["tokens"] / r["s"] for r in rows if r["path"].startswith("HF")}
    for r in rows:
        rate = r["tokens"] / r["s"]
        runs = ", ".join(f"{s:.2f}" for s in r["runs"])
        value = rate / peers[r["model"]] if speedup else peers[r["model"]] / rate
        print(
            f"| {r['model']} ({r['params'] / 1e6:.2f} M) | {r['path']} | {r['tokens']} | {r['s']:.2f} | {runs} | "
            f"{rate:.0f} | {value:.2f}x | {r.get('engine', '')} |"
        )
