"""The engine's KV cache (megarl/rollout/engine/kv_cache.py) against transformers' DynamicCache: the
time of one decode step, and of one decode step plus a finished row leaving, as the engine runs
them (forward_step, the engine's mask and attention), at several batch shapes.

    .venv/bin/python benchmarks/bench_kv_cache.py [--preset tiny-qwen3-moe] [--steps 30] [--repeats 3]

Each measurement prefills `rows` left-padded prompts (half the rows padded by half the width, as
continuous batching lays rows out), then times `--steps` decode steps (median), once as is and
once with a row leaving the batch after every step (`batch_select_indices`, the scheduler's
`keep_unfinished`), the engine's pattern on a long-tail workload. The two caches alternate
within each repeat (this host's speed drifts between minutes), and the logits of the two are
checked to be equal (the exit status is 1 when they are not).

--smoke: one shape (4 rows x 8), 6 decode steps, one repeat: checks the script and the cache.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megarl.models.tiny import build_tiny_checkpoint
from megarl.rollout.engine.attn_mask import forward_step, prepare_model
from megarl.rollout.engine.kv_cache import new_engine_cache


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny-qwen3-moe")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shapes", default="8x40,64x40,256x40,256x160", help="rows x prompt width, comma-separated")
    p.add_argument("--smoke", action="store_true", help="one small shape, 6 steps, 1 repeat (checks the script)")
    args = p.parse_args(argv)
    if args.smoke:  # smoke sizes replace the defaults only: flags given explicitly still win
        for key, value in dict(steps=6, repeats=1, shapes="4x8").items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    if args.steps < 4:
        p.error("--steps must be >= 4 (the first 3 decode steps are left out of the median)")
    return args


def decode_ms(model, make_cache, rows: int, width: int, steps: int, leave: bool):
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(5, vocab, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[: rows // 2, : width // 2] = 0
    last = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = make_cache()
    times = []
    with torch.inference_mode():
        logits = forward_step(model, ids, mask, last, cache, False).logits
        last = last[:, -1:]
        for _ in range(steps):
            n = mask.shape[0]
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, mask.new_ones(n, 1)], 1)
            last = last + 1
            t = time.perf_counter()
            logits = forward_step(model, nxt, mask, last, cache, False).logits
            if leave and n > 2:  # the row in the middle finished
                keep = torch.tensor([k for k in range(n) if k != n // 2])
                cache.batch_select_indices(keep)
                mask, last, logits = mask[keep], last[keep], logits[keep]
            times.append(time.perf_counter() - t)
    return statistics.median(times[3:]) * 1e3, logits


def main(argv=None):
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(1)
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:  # the model lives in memory once loaded
        path = build_tiny_checkpoint(Path(tmp) / args.preset, preset=args.preset)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prepare_model(model)
    print(
        f"{args.preset}, 1 torch thread, median of {args.steps} decode steps, best of {args.repeats} alternating repeats"
    )
    print("| rows x prompt | rows leave | DynamicCache ms/step | engine cache ms/step | ratio | logits equal |")
    print("|---|---|---|---|---|---|")
    unequal = []
    for shape in args.shapes.split(","):
        rows, width = map(int, shape.split("x"))
        for leave in (False, True):
            ours, theirs, equal = [], [], True
            for _ in range(args.repeats):
                t_ref, ref = decode_ms(model, DynamicCache, rows, width, args.steps, leave)
                t_ours, got = decode_ms(model, new_engine_cache, rows, width, args.steps, leave)
                theirs.append(t_ref)
                ours.append(t_ours)
                equal &= torch.equal(ref, got)
            if not equal:
                unequal.append(f"{shape}{' with rows leaving' if leave else ''}")
            print(
                f"| {rows} x {width}+{args.steps} | {'one per step' if leave else 'no'} | {min(theirs):.2f} | "
                f"{min(ours):.2f} | {min(theirs) / min(ours):.2f}x | {equal} |",
                flush=True,
            )
    if unequal:
        raise SystemExit(
            f"bench_kv_cache: the engine cache's logits differ from DynamicCache's at {', '.join(unequal)}"
        )


if __name__ == "__main__":
    main()
