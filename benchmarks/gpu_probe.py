"""What of megarl runs on a CUDA machine: one process, one GPU, each stage guarded and reported.

    python benchmarks/gpu_probe.py --out DIR [--stages env,ipc,engine,hf_speed]

Written for the rare GPU machine this project is lent (one H100, torch with CUDA, no network,
megatron-core / mbridge / transformers carried as wheels). Each stage runs on its own; a stage
that fails records its traceback instead of stopping the others, so one run says both what works
and exactly where the rest breaks. Results: DIR/gpu_probe.json and the printed lines.

Stages
  env       torch / CUDA / GPU facts.
  ipc       the colocated bridge's CUDA IPC path: a flattened bucket of CUDA tensors is packed and
            serialised by megarl.wire.weights_codec (as bridge/tensor.py sends it), and a spawned
            process decodes it through the same allow-list unpickler the rollout server uses and
            compares it bit for bit with the sender's tensors.
  engine    MegatronEngine on one GPU over NCCL (world size 1): the tiny Qwen3-MoE's log-probs
            against Hugging Face in float64 on the CPU (tests/engine/test_megatron_engine.py's rows), then one
            `train_mini_batch` step (finite grad norm, log-probs move).
  engine_speed  the engine's training step and forward against a plain HF + AdamW peer on the
            same weights and tokens (a Qwen3-MoE sized by --speed-*), alternating timed steps, in
            --precision fp32 (TF32 matmuls) or bf16 (engine: Megatron mixed precision; HF: bf16).
  hf_speed  a plain HF Qwen3-MoE training step in bf16 on the GPU at a realistic width, as the
            peer a later MFU comparison needs (tokens/s, model TFLOP/s by 6 x active params x tokens).

--smoke: every stage at tiny sizes (hidden 64, 1 x 64 tokens, one timed step); without CUDA on the
CPU (gloo, fp32; the ipc stage's tensors then travel as shared memory, not CUDA IPC handles), to
check the script itself in seconds. The exit status is 1 when a stage failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: --smoke, to check this script cheaply
SMOKE_STAGES = "env,ipc,engine,hf_speed,engine_speed"
# --smoke: sizes of the speed stages (flags given explicitly still win)
SMOKE = dict(
    layers=1,
    rows=1,
    seq=64,
    steps=1,
    speed_hidden=64,
    speed_layers=1,
    speed_experts=4,
    speed_topk=2,
    speed_rows=1,
    speed_seq=64,
)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _peak_mem_gib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 1) if DEVICE == "cuda" else None


def stage_env() -> dict:
    if DEVICE == "cpu":
        return dict(torch=torch.__version__, gpu=None)
    p = torch.cuda.get_device_properties(0)
    return dict(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        gpu=p.name,
        sms=p.multi_processor_count,
        memory_gib=round(p.total_memory / 2**30, 1),
        nccl=".".join(map(str, torch.cuda.nccl.version())),
    )


def _ipc_receiver(payload: str, expected_path: str, queue) -> None:
    try:
        from megarl.wire.weights_codec import decode_payload

        named = decode_payload(payload, "flattened_bucket")
        expected = torch.load(expected_path)
        result = {name: bool(torch.equal(t.cpu(), expected[name])) for name, t in named}
        result["_devices"] = sorted({str(t.device) for _, t in named})
        queue.put(result)
    except BaseException:  # reported to the parent
        queue.put({"_error": traceback.format_exc()})


def stage_ipc(tmp: str) -> dict:
    import torch.multiprocessing as mp

    from megarl.wire.weights_codec import pack_flattened_bucket, serialize

    g = torch.Generator(device=DEVICE).manual_seed(0)
    bucket = [
        ("a.weight", torch.randn(64, 32, device=DEVICE, generator=g)),
        ("b.bias", torch.randn(7, device=DEVICE, generator=g).to(torch.bfloat16)),
        ("c.weight", torch.randn(3, 5, 11, device=DEVICE, generator=g).half()),
    ]
    flat, metadata = pack_flattened_bucket(bucket)
    payload = serialize({"flattened_tensor": flat, "metadata": metadata})
    expected_path = os.path.join(tmp, "expected.pt")
    torch.save({n: t.cpu() for n, t in bucket}, expected_path)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_ipc_receiver, args=(payload, expected_path, queue))
    proc.start()
    result = queue.get(timeout=120)  # the sender (this process) holds `flat` alive until here
    proc.join(60)
    if "_error" in result:
        raise RuntimeError("receiver failed:\n" + result["_error"])
    ok = all(v for k, v in result.items() if not k.startswith("_")) and len(result) == len(bucket) + 1
    return dict(
        ok=ok, bit_exact=ok, tensors=len(bucket), payload_chars=len(payload), receiver_devices=result["_devices"]
    )


def _init_dist() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        if DEVICE == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)


def stage_engine(tmp: str) -> dict:
    from megarl.algo.losses import policy_loss
    from megarl.models.tiny import build_tiny_checkpoint
    from tests.engine.test_megatron_engine import _engine, hf_reference, make_rows

    _init_dist()
    path = build_tiny_checkpoint(os.path.join(tmp, "tiny-qwen3-moe"), seed=0)
    ref = hf_reference(path)
    out = {}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    engine = _engine(path, 1, 1, train=True)
    params = [p for chunk in engine.model for p in chunk.parameters()]
    out["param_devices"] = sorted({str(p.device) for p in params})
    out["param_dtypes"] = sorted({str(p.dtype) for p in params})
    rows = make_rows()
    t = time.perf_counter()
    before = engine.compute_log_prob(rows)["log_probs"]
    out["logprob_s"] = round(time.perf_counter() - t, 3)
    mask = rows["response_mask"].bool()
    out["logprob_device"] = str(before.device)
    out["logprob_max_abs_err_vs_hf_fp64"] = float((before.double().cpu() - ref)[mask].abs().max())

    def loss_fn(logp, ent, mb):
        m = mb["response_mask"]
        loss, metrics = policy_loss(logp, logp.detach(), mb["advantages"], m, global_denominator=1.0)
        return loss, m.sum(), {"pg_loss": metrics["pg_loss"]}

    t = time.perf_counter()
    metrics = engine.train_mini_batch(rows, loss_fn)
    out["train_step_s"] = round(time.perf_counter() - t, 3)
    out["grad_norm"] = float(metrics["actor/grad_norm"])
    after = engine.compute_log_prob(rows)["log_probs"]
    out["logprob_moved_by"] = float((after.double().cpu() - before.double().cpu())[mask].abs().max())
    out["ok"] = (
        out["logprob_max_abs_err_vs_hf_fp64"] < 1e-4
        and out["grad_norm"] == out["grad_norm"]
        and out["logprob_moved_by"] > 1e-6
    )
    return out


def stage_hf_speed(args) -> dict:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    width = (
        dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_attention_heads=4,
            head_dim=16,
            num_experts=8,
        )
        if args.smoke
        else dict(
            vocab_size=32768,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_attention_heads=32,
            head_dim=128,
            num_experts=64,
        )
    )
    cfg = Qwen3MoeConfig(
        **width,
        num_hidden_layers=args.layers,
        num_key_value_heads=4,
        num_experts_per_tok=8,
        max_position_embeddings=8192,
        torch_dtype="bfloat16",
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(DEVICE, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - expert + expert * cfg.num_experts_per_tok // cfg.num_experts
    ids = torch.randint(0, cfg.vocab_size, (args.rows, args.seq), device=DEVICE)
    times = []
    for i in range(args.steps + 1):
        _sync()
        t = time.perf_counter()
        logits = model(ids).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -logp.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        if i:
            times.append(time.perf_counter() - t)
        del logits, logp, loss
    step = sorted(times)[len(times) // 2]
    tokens = args.rows * args.seq
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * args.seq * tokens / 2
    flops = 6 * active * tokens + attn
    return dict(
        params_b=round(total / 1e9, 3),
        active_params_b=round(active / 1e9, 3),
        rows=args.rows,
        seq=args.seq,
        step_s=round(step, 4),
        tokens_per_s=round(tokens / step),
        model_tflops=round(flops / step / 1e12, 1),
        mfu_vs_989=round(flops / step / 989e12, 3),
        peak_mem_gib=_peak_mem_gib(),
    )


def stage_engine_speed(tmp: str, args) -> dict:
    """megarl's engine against a plain HF + AdamW step on the same fp32 weights and tokens (TF32
    matmuls on both sides; the engine builds fp32 parameters today)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megarl.algo.losses import policy_loss
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.data.batch import Batch
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    _init_dist()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    h = args.speed_hidden
    cfg = Qwen3MoeConfig(
        vocab_size=32768,
        hidden_size=h,
        intermediate_size=3 * h,
        moe_intermediate_size=h * 3 // 8,
        num_hidden_layers=args.speed_layers,
        num_attention_heads=max(h // 64, 4),
        num_key_value_heads=4,
        head_dim=64 if h <= 1024 else 128,
        num_experts=args.speed_experts,
        num_experts_per_tok=args.speed_topk,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    if h > 1024:
        cfg.num_attention_heads = h // 128 * 2
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(cfg)
    path = os.path.join(tmp, f"speed-qwen3-moe-{args.precision}")
    hf.save_pretrained(path)
    hf = hf.to(DEVICE, dtype).train()
    total = sum(p.numel() for p in hf.parameters())
    expert = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    active = total - expert + expert * cfg.num_experts_per_tok // cfg.num_experts
    rows, seq, prompt = args.speed_rows, args.speed_seq, 16
    ids = torch.randint(0, cfg.vocab_size, (rows, seq))
    batch = Batch(
        {
            "input_ids": ids,
            "responses": ids[:, prompt:],
            "response_mask": torch.ones(rows, seq - prompt),
            "prompt_lengths": torch.full((rows,), prompt),
            "advantages": torch.randn(rows, 1).expand(rows, seq - prompt).contiguous(),
        }
    )
    engine = MegatronEngine(
        EngineSpec(
            model_path=path,
            parallel=ParallelConfig(sequence_parallel=False),
            optim=OptimConfig(lr=1e-6, clip_grad=1.0),
            micro_batch_size=rows,
            precision=args.precision,
        )
    )
    engine.initialize()

    def loss_fn(logp, ent, mb):
        m = mb["response_mask"]
        loss, metrics = policy_loss(logp, logp.detach(), mb["advantages"], m, global_denominator=float(m.sum()))
        return loss, m.sum(), {}

    opt = torch.optim.AdamW(hf.parameters(), lr=1e-6)
    gids = ids.to(DEVICE)
    adv = batch["advantages"].to(DEVICE)

    def hf_step():
        logits = hf(gids).logits.float()
        logp = torch.log_softmax(logits[:, prompt - 1 : -1], -1).gather(-1, gids[:, prompt:, None]).squeeze(-1)
        loss = -(torch.exp(logp - logp.detach()) * adv).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(fn):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        return time.perf_counter() - t

    e_t, h_t, ef_t, hf_t = [], [], [], []
    for i in range(args.steps + 1):  # alternate, so drift hits both sides alike; first is warm-up
        a = timed(lambda: engine.train_mini_batch(batch, loss_fn))
        b = timed(hf_step)
        c = timed(lambda: engine.compute_log_prob(batch))
        with torch.no_grad():
            d = timed(lambda: torch.log_softmax(hf(gids).logits.float(), -1))
        if i:
            e_t.append(a), h_t.append(b), ef_t.append(c), hf_t.append(d)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    tokens = rows * seq
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq * tokens / 2
    flops = 6 * active * tokens + attn
    params = [(n, p) for chunk in engine.model for n, p in chunk.named_parameters()]
    out = dict(
        precision=args.precision,
        hidden=h,
        layers=cfg.num_hidden_layers,
        experts=cfg.num_experts,
        topk=cfg.num_experts_per_tok,
        engine_fp32_params=[n for n, p in params if p.dtype == torch.float32][:6],
        params_b=round(total / 1e9, 3),
        active_params_b=round(active / 1e9, 3),
        rows=rows,
        seq=seq,
        engine_train_s=round(med(e_t), 4),
        hf_train_s=round(med(h_t), 4),
        engine_fwd_s=round(med(ef_t), 4),
        hf_fwd_s=round(med(hf_t), 4),
    )
    out["train_ratio_engine_over_hf_tokens_per_s"] = round(med(h_t) / med(e_t), 3)
    out["fwd_ratio_engine_over_hf_tokens_per_s"] = round(med(hf_t) / med(ef_t), 3)
    out["engine_train_tflops"] = round(flops / med(e_t) / 1e12, 1)
    out["hf_train_tflops"] = round(flops / med(h_t) / 1e12, 1)
    out["engine_train_tokens_per_s"] = round(tokens / med(e_t))
    out["engine_train_mfu_vs_989"] = round(flops / med(e_t) / 989e12, 3)
    out["hf_train_mfu_vs_989"] = round(flops / med(h_t) / 989e12, 3)
    out["peak_mem_gib"] = _peak_mem_gib()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="where gpu_probe.json goes (default: .; --smoke: a temp dir)")
    ap.add_argument("--stages", default=None, help="default: env,ipc,engine,hf_speed (--smoke: all five)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="engine_speed: both sides")
    ap.add_argument("--speed-hidden", type=int, default=1024)
    ap.add_argument("--speed-layers", type=int, default=8)
    ap.add_argument("--speed-experts", type=int, default=32)
    ap.add_argument("--speed-topk", type=int, default=4)
    ap.add_argument("--speed-rows", type=int, default=8)
    ap.add_argument("--speed-seq", type=int, default=2048)
    ap.add_argument("--smoke", action="store_true", help="every stage at tiny sizes (CPU without CUDA)")
    args = ap.parse_args()
    args.out = args.out or (tempfile.mkdtemp(prefix="gpu_probe_smoke_") if args.smoke else ".")
    args.stages = args.stages or (SMOKE_STAGES if args.smoke else "env,ipc,engine,hf_speed")
    if args.smoke:
        for key, value in SMOKE.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.stages.split(","):
            fn = {
                "env": stage_env,
                "ipc": lambda: stage_ipc(tmp),
                "engine": lambda: stage_engine(tmp),
                "hf_speed": lambda: stage_hf_speed(args),
                "engine_speed": lambda: stage_engine_speed(tmp, args),
            }[name]
            t = time.perf_counter()
            try:
                results[name] = {"ok": True, **fn()}
            except BaseException:
                results[name] = {"ok": False, "error": traceback.format_exc()[-6000:]}
            results[name]["wall_s"] = round(time.perf_counter() - t, 1)
            print(name, json.dumps(results[name], indent=1), flush=True)
            with open(os.path.join(args.out, "gpu_probe.json"), "w") as f:
                json.dump(results, f, indent=1)
    failed = [name for name, r in results.items() if not r.get("ok")]
    if failed:
        sys.exit(f"gpu_probe: failed stages: {', '.join(failed)} (tracebacks above and in gpu_probe.json)")
    print(f"gpu_probe: every stage ok on {DEVICE}: {', '.join(results)}")


if __name__ == "__main__":
    main()
