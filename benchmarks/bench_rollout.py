"""Generation throughput of the embedded rollout server against plain Hugging Face `generate`.

    .venv/bin/python benchmarks/bench_rollout.py [--prompts 64] [--n 8] [--max-new-tokens 16]

Workload: --prompts chat prompts ("what is 12+7?" style, different lengths), --n samples each,
temperature 1, top_p 1, no top_k, exactly --max-new-tokens new tokens per sample (ignore_eos on
the server, min_new_tokens on the peer), so both sides produce the same number of tokens.

Four measurements per model, each the median of --repeats, all with one torch thread:
  megarl client : the production path, RolloutClient.generate (one /generate per prompt, all
                  concurrent, return_logprob=True as RolloutManager asks) against
                  `python -m megarl.rollout.server --torch-threads 1 --max-batch-size B`;
  megarl 1 req  : the same server, one batched /generate carrying every prompt (isolates the HTTP
                  and scheduling overhead of the per-prompt path);
  engine        : megarl's GenerationEngine in this process, no HTTP (diagnostic: engine vs serving);
  HF peer       : `model.generate(do_sample=True, num_return_sequences=n, use_cache=True)` on the
                  whole left-padded batch in this process, torch.set_num_threads(1).
Models: the tiny asset (hidden 64, 2 layers) and one ~9.5x its parameter count (hidden 128, 5 layers).
ratio = peer tokens/s / megarl tokens/s (1.0 = as fast as the peer; higher = megarl is slower).

    .venv/bin/python benchmarks/bench_rollout.py --mesh [--models tiny-x10]

    .venv/bin/python benchmarks/bench_rollout.py --mixed [--batch-size 16] [--long-fraction 0.1]

--mixed measures continuous batching on a long-tail workload instead: --prompts x --n rows, each
with its own length (most short: uniform in [--short-min, --short-max] new tokens; a
--long-fraction of them --long-tokens), exact (ignore_eos / min_new_tokens), same rows in the same
order for every path, at most --batch-size rows at once everywhere. HF `generate` runs static
batches of --batch-size rows in order (each batch until its longest row is done, as a synchronous
rollout does); megarl's engine, in process and behind its server (one batched /generate with
per-row sampling_params), keeps --batch-size rows running, queued rows joining as others finish;
the same engine with continuous_batching=False (static batches) shows what the joins buy.
tokens/s counts each row's own tokens only; speedup = this path's tokens/s / HF's.

--mesh measures the cost of the rollout mesh instead, same prompts, one run, one path for all
(RolloutClient with one /generate per prompt carrying its n samples, all concurrent, as the
manager sends them through a router): one tp=1 engine, one tp=2 engine (2 processes, gloo), and
two tp=1 engines behind sglang-router; plus the HF peer. On 2 cores the point is to know the
cost of the mesh, not to win.

--smoke (with any of the three): the tiny model, 4 prompts x n=2, 4 new tokens (--mixed: batches
of 4, lengths 2-4 and 8), one repeat: checks the script and every path in seconds.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

MODELS = {
    "tiny": {},
    "tiny-x10": dict(
        hidden_size=128, head_dim=32, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=5
    ),
}

# --smoke: replaces these defaults (flags given explicitly still win)
SMOKE = dict(
    prompts=4,
    n=2,
    max_new_tokens=4,
    models="tiny",
    repeats=1,
    batch_size=4,
    short_min=2,
    short_max=4,
    long_tokens=8,
    long_fraction=0.25,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--models", default="tiny,tiny-x10", help=f"comma-separated subset of {list(MODELS)}")
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=512,
        help="server --max-batch-size (default: the whole prompts*n batch fits in one)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--mesh", action="store_true", help="tp=1 vs tp=2 vs 2 engines behind sglang-router")
    p.add_argument("--router-policy", default="round_robin", help="sglang-router --policy for --mesh")
    p.add_argument("--mixed", action="store_true", help="long-tail lengths: continuous batching vs static HF")
    p.add_argument("--batch-size", type=int, default=16, help="--mixed: rows at once (engine and HF batches)")
    p.add_argument("--short-min", type=int, default=4)
    p.add_argument("--short-max", type=int, default=16)
    p.add_argument("--long-tokens", type=int, default=160)
    p.add_argument("--long-fraction", type=float, default=0.1)
    p.add_argument("--smoke", action="store_true", help="tiny model and workload, 1 repeat (checks the script)")
    args = p.parse_args(argv)
    if args.smoke:  # smoke sizes replace the defaults only: flags given explicitly still win
        for key, value in SMOKE.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    return args


def make_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        a, b = rng.randint(0, 10 ** rng.randint(1, 4)), rng.randint(0, 999)
        text = f"what is {a}{rng.choice('+-*')}{b}?" + " please" * rng.randint(0, 2)
        prompts.append(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
        )
    return [list(map(int, p)) for p in prompts]


def sampling(args) -> dict:
    return {"n": args.n, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}


# ---- the three measurements -------------------------------------------------------------------
def run_client(url: str, prompts, args, batched: bool = True) -> tuple[float, int, float | None]:
    from megarl.rollout.client.client import RolloutClient

    with RolloutClient(url, batched=batched) as client:
        start = time.perf_counter()
        outputs = client.generate(prompts, sampling(args), return_logprob=True)
        elapsed = time.perf_counter() - start
    return elapsed, _count_tokens([o.output_ids for o in outputs], len(prompts) * args.n), None


def run_one_request(url: str, prompts, args) -> tuple[float, int, float]:
    """Also returns the server's own view: the longest e2e_latency (request parsed -> result ready)."""
    body = {"input_ids": prompts, "sampling_params": sampling(args), "return_logprob": True}
    start = time.perf_counter()
    response = httpx.post(f"{url}/generate", json=body, timeout=600)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    items = response.json()
    engine_s = max(item["meta_info"]["e2e_latency"] for item in items)
    return elapsed, _count_tokens([item["output_ids"] for item in items], len(prompts) * args.n), engine_s


def run_engine_in_process(engine, prompts, args) -> tuple[float, int, None]:
    """The server's GenerationEngine without HTTP: separates engine cost from serving cost."""
    from megarl.rollout.engine.protocol import GenerationRequest, SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, ignore_eos=True)
    requests = [
        GenerationRequest(rid=f"{i}-{j}-{time.monotonic_ns()}", input_ids=p, params=params, return_logprob=True)
        for i, p in enumerate(prompts)
        for j in range(args.n)
    ]
    start = time.perf_counter()
    results = [f.result() for f in engine.submit(requests)]
    elapsed = time.perf_counter() - start
    return elapsed, _count_tokens([r.output_ids for r in results], len(prompts) * args.n), None


@torch.inference_mode()
def run_hf_peer(model, prompts, args) -> tuple[float, int, None]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        num_return_sequences=args.n,
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.max_new_tokens,
        use_cache=True,
        pad_token_id=0,
    )
    elapsed = time.perf_counter() - start
    return elapsed, _count_tokens(out[:, width:].tolist(), len(prompts) * args.n), None


def _count_tokens(outputs: list[list[int]], expected_rows: int) -> int:
    if len(outputs) != expected_rows:
        raise RuntimeError(f"got {len(outputs)} outputs, expected {expected_rows} (prompts * n)")
    return sum(len(o) for o in outputs)


def median_rate(fn, repeats: int) -> dict:
    runs = [fn() for _ in range(repeats)]
    tokens = {t for _, t, _ in runs}
    if len(tokens) != 1:
        raise RuntimeError(f"token counts differ between repeats: {sorted(tokens)}")
    in_engine = [e for _, _, e in runs if e is not None]
    return {
        "s": statistics.median(s for s, _, _ in runs),
        "tokens": tokens.pop(),
        "runs": [s for s, _, _ in runs],
        "engine_s": statistics.median(in_engine) if in_engine else None,
    }


def engine_stats(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=10).json()["engine_stats"]


def measure_hf_peer(model_dir: Path, prompts, args) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    run_hf_peer(model, prompts[:2], warmup_args(args))  # first-call allocations and lazy imports
    row = {
        "path": "HF generate (peer)",
        "params": sum(p.numel() for p in model.parameters()),
        **median_rate(lambda: run_hf_peer(model, prompts, args), args.repeats),
    }
    return row


def measure_engine(model_dir: Path, prompts, args) -> dict:
    from megarl.rollout.engine.generation import GenerationEngine

    engine = GenerationEngine(str(model_dir), max_batch_size=args.max_batch_size, seed=0)
    try:
        run_engine_in_process(engine, prompts[:2], warmup_args(args))
        return {
            "path": "megarl GenerationEngine in-process (no HTTP)",
            **median_rate(lambda: run_engine_in_process(engine, prompts, args), args.repeats),
        }
    finally:
        engine.close()


def measure_server(model_dir: Path, prompts, args) -> list[dict]:
    from megarl.rollout.fleet.server_process import RolloutServerProcess

    rows = []
    with RolloutServerProcess(model_dir, torch_threads=1, max_batch_size=args.max_batch_size) as server:
        run_one_request(server.url, prompts[:2], warmup_args(args))
        for path, fn in (
            ("megarl server, RolloutClient", run_client),
            ("megarl server, 1 batched request", run_one_request),
        ):
            before = engine_stats(server.url)
            row = {"path": path, **median_rate(lambda: fn(server.url, prompts, args), args.repeats)}
            row["engine"] = _stats_delta(before, engine_stats(server.url), args.repeats)
            if row["engine_s"] is not None:
                row["engine"] += f"; in the engine {row['engine_s']:.2f} s (longest e2e_latency)"
            rows.append(row)
    return rows


def measure_mesh(model_dir: Path, prompts, args) -> list[dict]:
    """One tp=1 engine, one tp=2 engine, two tp=1 engines behind sglang-router: per-prompt requests.

    The two tp=1 engines start together (start-up is not measured) and the first of them also
    gives the one-engine row; an engine with no requests waits on a condition, so the idle ones
    take no CPU from the one measured."""
    import concurrent.futures
    import contextlib

    from megarl.rollout.fleet.router import RouterProcess
    from megarl.rollout.fleet.server_process import RolloutServerProcess

    def server(*extra):
        return RolloutServerProcess(model_dir, torch_threads=1, max_batch_size=args.max_batch_size, extra_args=extra)

    def per_prompt(url):
        return lambda: run_client(url, prompts, args, batched=False)

    def measured(label: str, url: str) -> dict:
        run_client(url, prompts[:2], warmup_args(args), batched=False)
        return {"path": label, **median_rate(per_prompt(url), args.repeats)}

    with contextlib.ExitStack() as stack:
        engines = [server() for _ in range(2)]
        for engine in engines:
            stack.callback(engine.stop)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda e: e.start(), engines))
        rows = [measured("1 engine, tp=1", engines[0].url)]
        with server("--tp", "2") as tp2:
            rows.append(measured("1 engine, tp=2 (2 processes)", tp2.url))
        router = stack.enter_context(RouterProcess([e.url for e in engines], policy=args.router_policy))
        run_client(router.url, prompts[:2], warmup_args(args), batched=False)
        before = [engine_stats(e.url).get("requests_finished", 0) for e in engines]
        row = {
            "path": f"2 engines tp=1 behind sglang-router ({args.router_policy})",
            **median_rate(per_prompt(router.url), args.repeats),
        }
        shares = [engine_stats(e.url).get("requests_finished", 0) - b for e, b in zip(engines, before)]
        row["engine"] = f"requests per engine {shares}"
        rows.append(row)
    return rows


def warmup_args(args) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "n": 1})


def bench_model(name: str, model_dir: Path, args) -> list[dict]:
    from transformers import AutoTokenizer

    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), args.prompts)
    if args.mixed:
        from _mixed_lengths import measure_mixed

        rows = measure_mixed(model_dir, prompts, args, median_rate)
    elif args.mesh:
        rows = [measure_hf_peer(model_dir, prompts, args), *measure_mesh(model_dir, prompts, args)]
    else:
        rows = [
            measure_hf_peer(model_dir, prompts, args),
            measure_engine(model_dir, prompts, args),
            *measure_server(model_dir, prompts, args),
        ]
    for row in rows:
        row.update(model=name, params=rows[0]["params"])
    return rows


def _stats_delta(before: dict, after: dict, repeats: int) -> str:
    batches = (after.get("batches", 0) - before.get("batches", 0)) / repeats
    steps = (after.get("forward_steps", 0) - before.get("forward_steps", 0)) / repeats
    return f"{batches:.0f} batches, {steps:.0f} forward steps per run"


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from megarl.models.tiny import build_tiny_checkpoint

    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="megarl-bench-rollout-"))
    load_before, rows = os.getloadavg(), []
    try:
        for name in args.models.split(","):
            model_dir = build_tiny_checkpoint(workdir / name, seed=0, **MODELS[name])
            rows += bench_model(name, model_dir, args)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.mixed:
        from _mixed_lengths import print_mixed_table

        return print_mixed_table(rows, args, load_before, os.getloadavg())
    print_table(rows, args, load_before, os.getloadavg())


def print_table(rows, args, load_before, load_after) -> None:
    print(
        f"\n{args.prompts} prompts x n={args.n}, {args.max_new_tokens} new tokens each, 1 torch thread, "
        f"median of {args.repeats}; load average (1 min) before {load_before[0]:.2f}, after "
        f"{load_after[0]:.2f} on {os.cpu_count()} cores (other users of the cores add noise)"
    )
    from _mixed_lengths import print_rate_table

    print_rate_table(rows, speedup=False)


if __name__ == "__main__":
    main()
