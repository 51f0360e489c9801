"""Training speed of the Megatron engine: packed vs padded rows, and against a plain HF peer.

    .venv/bin/python benchmarks/bench_engine.py [--threads 2] [--steps 3]

One process, one gloo rank (world size 1), fp32, `--threads` torch threads, the same model for
both parts: a Qwen3-MoE of ~28M parameters (hidden 512, 4 layers, 8 experts top-2, vocab 1024,
random init). Each timed number is the median of `--steps` optimizer steps after one untimed
warm-up step; tokens/s counts real tokens only (prompt + response, never padding).

1. packed vs padded (`--rows 32`): a long-tail length mix, lengths drawn log-normal around a
   median of `--median` tokens and capped at 8x the median, the same rows and the same engine
   code; `actor.pack_sequences` true (THD, no padding) vs false (right-padded to the longest row).
   Each step: all rows in micro-batches of 8 rows, one policy-gradient loss, one Adam step.
2. engine vs HF peer (`--peer-rows` 16 x `--peer-len` 256 tokens, no padding anywhere): megarl's MegatronEngine
   (`train_mini_batch`: forward, log-probs of the tokens, backward, distributed-optimizer Adam step)
   against Hugging Face `Qwen3MoeForCausalLM` doing the same work in plain torch (forward,
   log_softmax + gather, the same loss, backward, torch.optim.AdamW) on the same weights and
   tokens; and forward only (`compute_log_prob` vs `torch.no_grad()` forward + log-probs). Both
   sides live in the process at once and their steps are timed alternately, so drift in the
   machine's speed hits both alike. ratio = megarl tokens/s / peer tokens/s (1.0 = as fast).

--smoke: a Qwen3-MoE of hidden 64 (2 layers, 4 experts), 8 rows around 16 tokens, the peer on
4 x 32 tokens, 1 thread, 1 timed step: checks the script and both parts in seconds.
"""

from __future__ import annotations

import argparse
import atexit
import math
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODEL = dict(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
)
SMOKE_MODEL = dict(
    MODEL,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
)
SMOKE = dict(threads=1, steps=1, rows=8, median=16, peer_rows=4, peer_len=32)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per measurement (median)")
    p.add_argument("--rows", type=int, default=32, help="rows of the long-tail mix")
    p.add_argument("--median", type=int, default=64, help="median row length of the long-tail mix")
    p.add_argument("--peer-rows", type=int, default=16, help="rows of the engine vs HF peer part")
    p.add_argument("--peer-len", type=int, default=256, help="tokens per row of the engine vs HF peer part")
    p.add_argument("--parts", default="packing,peer", help="comma-separated subset of packing,peer")
    p.add_argument("--workdir", default=None)
    p.add_argument("--smoke", action="store_true", help="a tiny model and batch, 1 step (checks the script)")
    args = p.parse_args(argv)
    if args.smoke:  # smoke sizes replace the defaults only: flags given explicitly still win
        for key, value in SMOKE.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    args.model = SMOKE_MODEL if args.smoke else MODEL
    return args


def long_tail_lengths(n: int, median: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [max(4, min(int(rng.lognormvariate(math.log(median), 0.9)), 8 * median)) for _ in range(n)]


def make_rows(lengths: list[int], vocab: int, seed: int = 0):
    """Right-padded rows whose first quarter is the prompt and the rest the response."""
    from megarl.data.batch import Batch

    gen = torch.Generator().manual_seed(seed)
    T = max(lengths)
    plen = torch.tensor([max(1, n // 4) for n in lengths])
    R = int(max(n - p for n, p in zip(lengths, plen.tolist())))
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    responses = torch.zeros(len(lengths), R, dtype=torch.long)
    mask = torch.zeros(len(lengths), R)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(2, vocab, (n,), generator=gen)
        p = int(plen[i])
        responses[i, : n - p] = ids[i, p:n]
        mask[i, : n - p] = 1
    adv = torch.randn(len(lengths), 1, generator=gen) * mask
    return Batch(
        {
            "input_ids": ids,
            "prompt_lengths": plen,
            "responses": responses,
            "response_mask": mask,
            "advantages": adv,
            "old_log_probs": torch.zeros_like(mask),
        }
    )


def pg_loss(logp, ent, mb):
    mask = mb["response_mask"]
    return -(logp * mb["advantages"] * mask).sum(), mask.sum(), {}


def make_engine(model_path: str, packed: bool, micro_batch_size: int, train: bool = True, precision: str = "fp32"):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    engine = MegatronEngine(
        EngineSpec(
            model_path=model_path,
            parallel=ParallelConfig(),
            micro_batch_size=micro_batch_size,
            optim=OptimConfig(lr=1e-5, clip_grad=1.0) if train else None,
            pack_sequences=packed,
            precision=precision,
        )
    )
    engine.initialize()
    return engine


def timed(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_packing(model_path: str, args) -> list[tuple]:
    lengths = long_tail_lengths(args.rows, args.median)
    rows = make_rows(lengths, args.model["vocab_size"])
    tokens = sum(lengths)
    out = []
    for packed in (False, True):
        engine = make_engine(model_path, packed, micro_batch_size=8)
        head = engine.logprob_head(1.0, entropy_grad=False)
        seconds = timed(lambda: engine.train_mini_batch(rows, pg_loss, head=head), args.steps)
        out.append(("packed" if packed else "padded", tokens / seconds, seconds))

    print(
        f"lengths: {len(lengths)} rows, median {statistics.median(lengths):.0f}, max {max(lengths)}, "
        f"{tokens} real tokens, {len(lengths) * max(lengths)} padded tokens"
    )
    return out


def hf_peer(model_path: str, rows, device: str = "cpu", dtype=torch.float32):
    """Plain HF + torch on `rows` (no padding): (training step, forward) callables."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    ids, responses, mask, adv = (rows[k].to(device) for k in ("input_ids", "responses", "response_mask", "advantages"))
    p = int(rows["prompt_lengths"][0])
    R = responses.shape[1]

    def logp():
        logits = model(ids).logits[:, p - 1 : p - 1 + R]
        return torch.log_softmax(logits.float(), -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)

    def step():
        model.train()
        opt.zero_grad(set_to_none=True)
        loss = -(logp() * adv * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def forward():
        model.eval()
        with torch.no_grad():
            logp()

    return step, forward


def interleaved(ours, peer, steps: int) -> tuple[float, float]:
    """Median seconds of each, timed alternately (one warm-up each) so drift hits both alike."""
    ours(), peer()
    t_ours, t_peer = [], []
    for _ in range(steps):
        for fn, out in ((ours, t_ours), (peer, t_peer)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(t_ours), statistics.median(t_peer)


def bench_peer(model_path: str, args) -> list[tuple]:
    rows = make_rows([args.peer_len] * args.peer_rows, args.model["vocab_size"], seed=1)
    tokens = args.peer_rows * args.peer_len
    peer_step, peer_forward = hf_peer(model_path, rows)
    engine = make_engine(model_path, packed=True, micro_batch_size=args.peer_rows)
    # as MegatronActor.update_actor runs it: the entropy is a metric (no backward) without entropy_coeff
    head = engine.logprob_head(1.0, entropy_grad=False)
    train, peer_train = interleaved(lambda: engine.train_mini_batch(rows, pg_loss, head=head), peer_step, args.steps)
    ref = make_engine(model_path, packed=True, micro_batch_size=args.peer_rows, train=False)
    fwd, peer_fwd = interleaved(lambda: ref.compute_log_prob(rows), peer_forward, args.steps)
    return [("train", tokens / train, tokens / peer_train), ("forward", tokens / fwd, tokens / peer_fwd)]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    from megarl.models.tiny import build_tiny_checkpoint

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_engine_"))
    if args.workdir is None:  # a temporary work directory goes at exit
        atexit.register(shutil.rmtree, work, True)
    model_path = str(build_tiny_checkpoint(work / "model", seed=0, **args.model))
    store = dist.FileStore(str(work / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    n_params = sum(
        t.numel()
        for t in __import__("safetensors.torch", fromlist=["load_file"])
        .load_file(os.path.join(model_path, "model.safetensors"))
        .values()
    )
    print(f"model: Qwen3-MoE {n_params / 1e6:.1f}M parameters, {args.threads} threads, median of {args.steps} steps")
    parts = args.parts.split(",")
    if "packing" in parts:
        res = bench_packing(model_path, args)
        print("\n| layout | tokens/s | s/step |\n|---|---|---|")
        for name, tps, sec in res:
            print(f"| {name} | {tps:,.0f} | {sec:.2f} |")
        print(f"packed / padded = {res[1][1] / res[0][1]:.2f}x (goal >= 1.5x)")
    if "peer" in parts:
        res = bench_peer(model_path, args)
        print("\n| pass | megarl tokens/s | HF peer tokens/s | ratio |\n|---|---|---|---|")
        for name, ours, peer in res:
            print(f"| {name} | {ours:,.0f} | {peer:,.0f} | {ours / peer:.2f}x |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
