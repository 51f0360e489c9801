"""Weight-sync throughput of the bridge into one embedded rollout server, against a raw-copy peer.

    .venv/bin/python benchmarks/bench_bridge.py [--bucket-mb 4,16,64,256] [--repeats 3]

The "trainer" is this process: it builds a Qwen3-MoE checkpoint of 108 MiB fp32 (hidden 512,
4 layers, 8 experts by default; 135 tensors, experts 1 MiB each), loads model.safetensors as its weights and starts one embedded
server (`python -m megarl.rollout.server --torch-threads 1`) on the same checkpoint. Every sync
first changes the trainer's weights (so a stale server is caught), then times one complete
`TensorWeightSender.send` / `DiskWeightSender.send`, then checks the server: greedy /generate with
prompt and output log-probs must equal a local Hugging Face forward with the trainer's weights
within --atol. The embedded server has no /get_weights_by_name, so log-probs are the check.

Peers, measured in the same run on the same bytes:
  tensor: one process, per bucket `torch.cat` into a fresh buffer, then `copy_` into preallocated
          destination tensors (the two copies any handle-based transport cannot avoid);
  disk:   safetensors `save_file` + `load_file` of the same tensors in the same directory.
Each cell is the median of --repeats runs; GB/s = 1e9 bytes/s; bucket sizes are MiB. ratio =
bridge time / peer time (1.0 = as fast as a raw copy; higher is slower). Senders live across
syncs as in training (one untimed warm-up sync each).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

MB = 1 << 20
PROMPTS = [[2, 10, 20, 11, 6, 3], [2, 31, 32, 33, 34, 35, 36, 37, 3], [2, 15, 16, 40, 41, 3]]
BIG_MODEL = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=64, intermediate_size=1024, moe_intermediate_size=512, num_experts=8)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bucket-mb", default="4,16,64,256", help="comma-separated tensor bucket sizes (MiB)")
    p.add_argument("--transports", default="tensor,disk", help="comma-separated subset of tensor,disk")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden-size", type=int, default=BIG_MODEL["hidden_size"])
    p.add_argument("--layers", type=int, default=BIG_MODEL["num_hidden_layers"])
    p.add_argument("--experts", type=int, default=BIG_MODEL["num_experts"])
    p.add_argument("--moe-intermediate-size", type=int, default=BIG_MODEL["moe_intermediate_size"])
    p.add_argument("--atol", type=float, default=1e-4, help="log-prob tolerance of the correctness check")
    p.add_argument("--workdir", default=None, help="checkpoint + disk-transport directory (default: a temp dir "
                                                   "under /tmp, removed at the end)")
    args = p.parse_args(argv)
    unknown = set(args.transports.split(",")) - {"tensor", "disk"}
    if unknown:
        p.error(f"--transports: unknown {sorted(unknown)}; use a comma-separated subset of tensor,disk")
    return args


def model_overrides(args) -> dict:
    return {**BIG_MODEL, "hidden_size": args.hidden_size, "num_hidden_layers": args.layers,
            "num_experts": args.experts, "moe_intermediate_size": args.moe_intermediate_size,
            "intermediate_size": 2 * args.hidden_size, "num_attention_heads": args.hidden_size // 64,
            "num_key_value_heads": max(1, args.hidden_size // 128)}


# ---- the trainer side: weights, a local reference model, the correctness check -------------------
def load_trainer(model_dir: Path):
    """(name -> tensor, HF model whose parameters ARE those tensors): perturbing one moves both."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    weights = {name: t.clone() for name, t in load_file(str(model_dir / "model.safetensors")).items()}
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32).eval()
    model.load_state_dict(weights, assign=True)
    shared = {n: p.data_ptr() for n, p in model.state_dict().items()}
    if any(shared[n] != t.data_ptr() for n, t in weights.items()):
        raise RuntimeError("the local reference model does not share storage with the trainer weights")
    return weights, model


@torch.no_grad()
def perturb(weights: dict[str, torch.Tensor], step: int) -> None:
    """A new weight version: every tensor moves, so any stale tensor on the server shows up."""
    for t in weights.values():
        t.add_(1e-3 if step % 2 else -7e-4)


def server_logprobs(url: str) -> list[tuple[list[int], list[float]]]:
    """(prompt + greedy output ids, log-prob of every token after the first) from the server."""
    body = {"input_ids": PROMPTS, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    response.raise_for_status()
    out = []
    for prompt, item in zip(PROMPTS, response.json()):
        meta = item["meta_info"]
        lps = [t[0] for t in meta["input_token_logprobs"][1:]] + [t[0] for t in meta["output_token_logprobs"]]
        out.append((prompt + item["output_ids"], lps))
    return out


@torch.no_grad()
def max_logprob_error(model, answers) -> float:
    """Largest |server - local| log-prob over all checked tokens (raw logits, as for temperature 0)."""
    worst = 0.0
    for ids, server_lps in answers:
        ids_t = torch.tensor([ids])
        logits = model(input_ids=ids_t).logits[0, :-1].float()
        local = torch.log_softmax(logits, -1).gather(-1, ids_t[0, 1:, None])[:, 0]
        worst = max(worst, (local - torch.tensor(server_lps)).abs().max().item())
    return worst


# ---- one timed sync per transport, and its peer ---------------------------------------------------
def timed_send(sender, weights: dict, version: str) -> float:
    """One complete sync through a sender that lives for the whole run, as in training."""
    start = time.perf_counter()
    sender.send(list(weights.items()), version)
    return time.perf_counter() - start


def peer_memcpy(weights: dict, dest: dict, bucket_bytes: int) -> float:
    from megarl.bridge.buckets import iter_buckets

    start = time.perf_counter()
    for bucket in iter_buckets(weights.items(), bucket_bytes):
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
        offset = 0
        for name, t in bucket:
            n = t.numel() * t.element_size()
            dest[name].view(-1).view(torch.uint8).copy_(flat[offset:offset + n])
            offset += n
    return time.perf_counter() - start


def peer_safetensors(weights: dict, directory: Path) -> float:
    from safetensors.torch import load_file, save_file

    path = directory / "peer.safetensors"
    start = time.perf_counter()
    save_file(weights, str(path), metadata={"format": "pt"})
    loaded = load_file(str(path))
    elapsed = time.perf_counter() - start
    if len(loaded) != len(weights):
        raise RuntimeError(f"safetensors round trip lost tensors: {len(loaded)} of {len(weights)}")
    path.unlink()
    return elapsed


# ---- the run --------------------------------------------------------------------------------------
def measure(label, sync, peer, *, repeats, weights, model, url, atol, state) -> dict:
    """Per repeat: new weight version, timed bridge sync, correctness check, timed peer."""
    bridge_s, peer_s, errors = [], [], []
    for _ in range(repeats):
        state["step"] += 1
        perturb(weights, state["step"])
        stale = max_logprob_error(model, server_logprobs(url)) if state["step"] == 1 else None
        if stale is not None:
            if stale <= atol:
                raise RuntimeError(f"the check has no teeth: a stale server differs by only {stale:.2e}")
            state["stale_err"] = stale
        bridge_s.append(sync(f"v{state['step']}"))
        error = max_logprob_error(model, server_logprobs(url))
        if error > atol:
            raise RuntimeError(f"{label}: after sync v{state['step']} the server's log-probs differ from the "
                               f"trainer's by {error:.2e} > atol {atol:.0e}; the bridge delivered wrong weights")
        errors.append(error)
        peer_s.append(peer())
    return {"label": label, "bridge_s": statistics.median(bridge_s), "peer_s": statistics.median(peer_s),
            "max_err": max(errors), "runs": bridge_s}


def run_all(args, url, weights, model, dest, disk_dir) -> tuple[list[dict], dict]:
    from megarl.bridge import DiskWeightSender, TensorWeightSender

    state, rows = {"step": 0}, []
    common = dict(repeats=args.repeats, weights=weights, model=model, url=url, atol=args.atol, state=state)
    buckets_mb = [int(x) for x in args.bucket_mb.split(",")]
    for transport in args.transports.split(","):
        if transport == "tensor":
            for mb in buckets_mb:
                sender = TensorWeightSender([url], mb * MB)
                try:
                    # one untimed sync: the shared buffer's first touch and first-call imports
                    # are start-up, not bandwidth (training keeps one sender for the whole run)
                    timed_send(sender, weights, f"warmup-{mb}")
                    rows.append(measure(f"tensor, bucket {mb} MiB",
                                        lambda v, s=sender: timed_send(s, weights, v),
                                        lambda b=mb * MB: peer_memcpy(weights, dest, b), **common))
                finally:
                    sender.close()
        elif transport == "disk":
            sender = DiskWeightSender([url], str(disk_dir))
            timed_send(sender, weights, "warmup-disk")
            rows.append(measure("disk", lambda v: timed_send(sender, weights, v),
                                lambda: peer_safetensors(weights, disk_dir), **common))
    return rows, state


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from megarl.models.tiny import build_tiny_checkpoint
    from megarl.rollout.launcher import RolloutServerProcess

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="megarl-bench-bridge-"))
    try:
        t0 = time.perf_counter()
        model_dir = build_tiny_checkpoint(workdir / "model", seed=0, **model_overrides(args))
        weights, model = load_trainer(model_dir)
        total = sum(t.numel() * t.element_size() for t in weights.values())
        print(f"model: {len(weights)} tensors, {total / MB:.1f} MiB fp32, built+loaded in "
              f"{time.perf_counter() - t0:.1f}s")
        dest = {n: torch.empty_like(t) for n, t in weights.items()}
        disk_dir = workdir / "sync"
        disk_dir.mkdir(exist_ok=True)
        load_before = os.getloadavg()
        with RolloutServerProcess(model_dir, torch_threads=1, max_batch_size=8) as server:
            rows, run_state = run_all(args, server.url, weights, model, dest, disk_dir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nload average (1 min) before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} cores (other users of the cores add noise)")
    print(f"check: before the first sync the (stale) server's log-probs differed by {run_state['stale_err']:.2e}; "
          f"every sync must bring that under --atol {args.atol:.0e}")
    print_table(rows, total, args.repeats)


def print_table(rows, total_bytes, repeats) -> None:
    gb = total_bytes / 1e9
    print(f"\n| transport | bridge s (median of {repeats}) | bridge runs | bridge GB/s | peer s | peer GB/s | "
          f"ratio bridge/peer | max log-prob err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        runs = ", ".join(f"{s:.3f}" for s in r["runs"])
        print(f"| {r['label']} | {r['bridge_s']:.3f} | {runs} | {gb / r['bridge_s']:.2f} | {r['peer_s']:.3f} | "
              f"{gb / r['peer_s']:.2f} | {r['bridge_s'] / r['peer_s']:.2f}x | {r['max_err']:.1e} |")


if __name__ == "__main__":
    main()
