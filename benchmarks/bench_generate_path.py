"""Where one batched /generate of the quickstart goes: the HTTP path against the engine alone and HF.

    .venv/bin/python benchmarks/bench_generate_path.py [--model DIR] [--rows 256] [--new 2] [--repeats 40]

The quickstart's generation stage is one batched /generate per engine: 16 prompts x 16 samples =
256 rows, each with its own sampling_seed (RolloutManager's seeded rows), 2 new tokens, with
log-probs. One torch thread everywhere. Three measurements, each the median (and min) of
--repeats, timed alternately so the machine's drift hits all alike:

  client.generate : RolloutClient.generate against `python -m megarl.rollout.server` (the loop's
                    path: JSON request, parse, engine, answer items, JSON answer, client parse);
  engine alone    : GenerationEngine.submit of the same parsed requests in this process;
  HF generate     : transformers' `generate` on the same 256 left-padded rows (the peer TRL uses).

Then the host-side pieces of the call, each timed on its own in this process: the request's
JSON, `parse_generate`, `output_item` for every row, the answer's JSON (orjson, as the server
renders it, next to json.dumps with starlette's options) and the client's parse of it.
--model defaults to bench_vs_trl.py's quickstart checkpoint (built if missing).

--smoke: 32 rows, one repeat (checks the script and every path in seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF checkpoint (default: the quickstart's, built if missing)")
    p.add_argument("--rows", type=int, default=256, help="rows (16 samples per prompt)")
    p.add_argument("--new", type=int, default=2, help="new tokens per row")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    p.add_argument("--smoke", action="store_true", help="32 rows, 1 repeat (checks the script)")
    args = p.parse_args(argv)
    if args.smoke:  # smoke sizes replace the defaults only: flags given explicitly still win
        args.rows = 32 if args.rows == p.get_default("rows") else args.rows
        args.repeats = 1 if args.repeats == p.get_default("repeats") else args.repeats
    return args


def quickstart_model() -> str:
    from megarl.models.tiny import build_tiny_checkpoint

    path = ROOT / "outputs" / "bench_generate_path" / "model"
    if not (path / "config.json").exists():
        build_tiny_checkpoint(path, seed=0, preset="tiny-qwen3-moe")
    return str(path)


def stats(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:7.2f} ms (min {min(times) * 1e3:.2f})"


def timed(fn, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from megarl.rollout.client.client import RolloutClient, _fields
    from megarl.rollout.engine.generation import GenerationEngine
    from megarl.rollout.server.generate_input import parse_generate
    from megarl.rollout.server.generate_output import output_item

    model = args.model or quickstart_model()
    if not args.port:
        from megarl.procs.net import free_port

        args.port = free_port("127.0.0.1")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megarl.rollout.server",
            "--model-path",
            model,
            "--port",
            str(args.port),
            "--torch-threads",
            "1",
            "--max-batch-size",
            str(args.rows),
            "--log-level",
            "warning",
        ]
    )
    try:
        client = RolloutClient(f"http://127.0.0.1:{args.port}")
        engine = GenerationEngine(model, max_batch_size=args.rows, seed=0)
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        prompts = [[1, 5 + i % 7, 6 + i % 5, 7, 2][: 3 + i % 3] for i in range(max(1, args.rows // 16))]
        ids = [p for p in prompts for _ in range(16)][: args.rows]
        params = [
            {"max_new_tokens": args.new, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "sampling_seed": 1000 + k}
            for k in range(len(ids))
        ]
        body = {"input_ids": ids, "sampling_params": params, **_fields(True, False)}
        width = max(map(len, ids))
        hf_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])
        hf_mask = (hf_ids != 0).long()
        deadline = time.time() + 120
        while not client.health():
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("bench_generate_path: the rollout server did not come up")
            time.sleep(0.2)

        def via_http() -> float:
            start = time.perf_counter()
            client.generate(ids, params, return_logprob=True)
            return time.perf_counter() - start

        def engine_alone() -> float:  # the same parsed requests; submit to the last result
            requests = parse_generate(json.loads(json.dumps(body)), engine).requests
            start = time.perf_counter()
            for future in engine.submit(requests):
                future.result()
            return time.perf_counter() - start

        def hf_generate() -> float:
            start = time.perf_counter()
            with torch.no_grad():
                hf.generate(
                    input_ids=hf_ids,
                    attention_mask=hf_mask,
                    do_sample=True,
                    max_new_tokens=args.new,
                    min_new_tokens=args.new,
                    pad_token_id=0,
                    top_k=0,
                    top_p=1.0,
                    temperature=1.0,
                )
            return time.perf_counter() - start

        paths = {"client.generate (HTTP)": via_http, "engine alone": engine_alone, "HF generate": hf_generate}
        times = {name: [] for name in paths}
        for fn in paths.values():
            fn()
        for _ in range(args.repeats):
            for name, fn in paths.items():
                times[name].append(fn())

        raw = json.dumps(body)
        call = parse_generate(json.loads(raw), engine)
        results = [f.result() for f in engine.submit(call.requests)]
        items = [output_item(r, q, call, lambda t: engine.decode([t], False)) for r, q in zip(results, call.requests)]
        answer = orjson.dumps(items)
        pieces = {
            "request json.dumps (client)": lambda: json.dumps(body),
            "request json.loads (server)": lambda: json.loads(raw),
            "parse_generate (server)": lambda: parse_generate(json.loads(raw), engine),
            "output_item x rows (server)": lambda: [
                output_item(r, q, call, lambda t: engine.decode([t], False)) for r, q in zip(results, call.requests)
            ],
            "answer orjson.dumps (server)": lambda: orjson.dumps(items),
            "answer json.dumps, starlette's options (before)": lambda: json.dumps(
                items, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
            ).encode(),
            "answer orjson.loads (client)": lambda: orjson.loads(answer),
            "answer json.loads (before)": lambda: json.loads(answer),
        }
        print(
            f"model {model}, {len(ids)} rows x {args.new} new tokens, request {len(raw) / 1e3:.0f} kB, "
            f"answer {len(answer) / 1e3:.0f} kB, median of {args.repeats}\n"
        )
        print("| path | time |\n|---|---|")
        for name, t in times.items():
            print(f"| {name} | {stats(t)} |")
        print("\n| piece | time |\n|---|---|")
        for name, fn in pieces.items():
            print(f"| {name} | {stats(timed(fn, args.repeats))} |")
        engine.close()
        client.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
