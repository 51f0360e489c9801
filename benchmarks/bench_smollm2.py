"""SmolLM2-135M's RL step against plain Hugging Face peers doing the same work, in one run.

    .venv/bin/python benchmarks/bench_smollm2.py [--config configs/smollm2-add20.yaml] [--steps 8]
                                                 [--warmup 3] [--json out.json] [override ...]

1. megarl: `megarl train CONFIG` for --steps steps (validation off; profile_step.py's run): the
   median of each stage over the steps after --warmup (generation, update, weight sync, the
   step) and the CPU seconds per step of every process.
2. The peers, in this process once the run has ended (nothing else computes then), fp32, on the
   same shapes: the config's first batch of prompts in the model's chat template, each repeated
   rollout.n times.
   - generate: transformers' `generate`, sampled at rollout.temperature, every row exactly
     rollout.max_new_tokens tokens (megarl's rows stop at end-of-sequence, so this is at least
     the work its engine did), with the engine's threads (rollout.torch_threads);
   - train step: the same rows with the run's mean response length: forward, log-probs of the
     response tokens, a token-mean policy-gradient loss, backward, AdamW step; one process with as
     many threads as megarl has actor ranks (each rank runs one), so both use the same cores;
   - weight copy: the model's state dict copied once into preallocated tensors (torch copy_): the
     floor under a weight sync that moves every byte once.
   ratio = megarl's seconds / the peer's (1.0: as fast; below 1: faster).

--smoke: 3 steps, 1 of warm-up, 2 prompts x 2 samples of 4 new tokens, on SmolLM2's first two
layers (the real weights and tokenizer, the other 28 layers dropped): checks the script end to end,
not its numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smollm2-add20.yaml")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each peer (the median is reported)")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--smoke", action="store_true", help="3 steps, 1 warm-up, 2 prompts x 2 samples x 4 tokens, 2 layers"
    )
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides (both sides see them)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.repeats = 3, 1, 1
        args.overrides += [
            "data.train_batch_size=2",
            "rollout.n=2",
            "rollout.max_new_tokens=4",
            "actor.ppo_mini_batch_size=4",
            "actor.micro_batch_size=1",
        ]
    return args


SMOKE_LAYERS = 2


def shallow_copy(model_path: str, layers: int, out: Path) -> Path:
    """The HF folder at model_path cut to its first `layers` decoder layers, written to out."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = Path(model_path)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    keep = {}
    for name, t in load_file(src / "model.safetensors").items():
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= layers:
            continue
        keep[name] = t
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    return out


def megarl_side(args, output_dir: Path) -> dict:
    """profile_step's run of the config: stage medians, CPU per process, the mean response length."""
    import profile_step

    run_args = argparse.Namespace(
        steps=args.steps,
        warmup=args.warmup,
        config=args.config,
        rate=100,
        no_spy=True,
        overrides=args.overrides,
    )
    res = profile_step.run(run_args, output_dir)
    rows = [json.loads(x) for x in (output_dir / f"profile_step_{os.getpid()}" / "metrics.jsonl").open()]
    res["response_length_mean"] = statistics.mean(r["response/length_mean"] for r in rows[args.warmup :])
    return res


def peer_inputs(cfg, model_path: str):
    """The config's first batch of prompts in the chat template, each repeated rollout.n times."""
    from transformers import AutoTokenizer

    from megarl.data.dataset import tokenize_prompt
    from megarl.data.tasks import generate_task

    tok = AutoTokenizer.from_pretrained(model_path)
    rows = generate_task(cfg.data.task, cfg.data.train_batch_size, cfg.data.seed)
    prompts = [tokenize_prompt(tok, r["prompt"]) for r in rows for _ in range(cfg.rollout.n)]
    return tok, prompts


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def hf_generate(model, tok, prompts, cfg, repeats: int) -> float:
    width = max(map(len, prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    r = cfg.rollout
    torch.set_num_threads(r.torch_threads)

    def run():
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=r.max_new_tokens,
                min_new_tokens=r.max_new_tokens,
                do_sample=r.temperature > 0,
                temperature=r.temperature or None,
                top_p=None,
                top_k=None,
                pad_token_id=pad,
            )

    return median_time(run, repeats)


def hf_train_step(model, prompts, response_len: int, cfg, repeats: int) -> float:
    """One optimizer step over the rows, micro-batched as one actor rank would be, in one process."""
    torch.set_num_threads(cfg.cluster.num_actor_ranks)
    gen = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    rows = [p + torch.randint(0, vocab, (response_len,), generator=gen).tolist() for p in prompts]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.actor.optim.lr)
    micro = cfg.actor.micro_batch_size * cfg.cluster.num_actor_ranks

    def run():
        for k in range(0, len(rows), micro):
            chunk = rows[k : k + micro]
            width = max(map(len, chunk))
            ids = torch.tensor([r + [0] * (width - len(r)) for r in chunk])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk])
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            resp = torch.zeros_like(lp)
            for i, r in enumerate(chunk):
                resp[i, len(r) - 1 - response_len : len(r) - 1] = 1.0
            adv = torch.randn(len(chunk), 1, generator=gen)
            loss = -(lp * adv * resp).sum() / resp.sum() * len(chunk) / len(rows)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return median_time(run, repeats)


def weight_copy(model, repeats: int) -> tuple[float, float]:
    """(seconds to copy every tensor of the state dict once, MiB)."""
    state = model.state_dict()
    targets = {k: torch.empty_like(v) for k, v in state.items()}

    def run():
        for k, v in state.items():
            targets[k].copy_(v)

    unique = {v.data_ptr(): v for v in state.values()}  # tied embeddings: one tensor under two names
    return median_time(run, repeats), sum(v.numel() * v.element_size() for v in unique.values()) / 2**20


def main(argv=None) -> dict:
    from transformers import AutoModelForCausalLM

    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.models.smollm2 import materialize

    args = parse_args(argv)
    cfg = validate(load_config(ROOT / args.config, args.overrides))
    model_path = cfg.model.path or str(materialize())
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            (Path(tmp) / "model").mkdir()
            model_path = str(shallow_copy(model_path, SMOKE_LAYERS, Path(tmp) / "model"))
            args.overrides.append(f"model.path={model_path}")
            cfg = validate(load_config(ROOT / args.config, args.overrides))
        ours = megarl_side(args, Path(tmp))
        tok, prompts = peer_inputs(cfg, model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    response_len = max(1, round(ours["response_length_mean"]))
    peers = {
        "gen": hf_generate(model.eval(), tok, prompts, cfg, args.repeats),
        "update": hf_train_step(model.train(), prompts, response_len, cfg, args.repeats),
    }
    peers["sync"], mib = weight_copy(model, args.repeats)
    st = ours["stages_s"]
    rows = len(prompts)
    print(f"{rows} rows of ~{statistics.mean(map(len, prompts)):.0f} prompt tokens, response mean {response_len}")
    print(f"{'stage':<8} {'megarl s':>9} {'peer s':>8} {'ratio':>6}  peer")
    names = {
        "gen": f"HF generate, {cfg.rollout.max_new_tokens} tokens every row, {cfg.rollout.torch_threads} thread(s)",
        "update": f"HF forward+backward+AdamW, {cfg.cluster.num_actor_ranks} threads",
        "sync": f"copy_ of the state dict ({mib:.0f} MiB)",
    }
    for key in ("gen", "update", "sync"):
        mine = st.get(key, float("nan"))
        print(f"{key:<8} {mine:9.3f} {peers[key]:8.3f} {mine / peers[key]:6.2f}  {names[key]}")
    print(f"step     {st.get('step', float('nan')):9.3f} (load average {' '.join(ours['loadavg'])})")
    cpu = ours["cpu_s_per_step"]
    print("CPU s per step: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])))
    result = {"megarl": ours, "peers_s": peers, "rows": rows, "response_len": response_len, "state_mib": mib}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
