"""megarl on one GPU: parity in fp32 and bf16, a weight update over CUDA IPC, and MFU vs a HF peer.

    python3 benchmarks/bench_gpu.py --out DIR [--stages env,parity,rollout_ipc,mfu_moe,mfu_dense]

For the rare GPU machine this project is lent (one H100; torch with CUDA; megatron-core, mbridge and
transformers 4.57.6 carried as wheels). One process, NCCL, world size 1. Each stage runs on its own
and a failing one records its traceback instead of stopping the rest. Results: DIR/bench_gpu.json
and a table printed last.

Stages
  env          torch / CUDA / GPU facts.
  parity       the tiny Qwen3-MoE (tests/engine/test_megatron_engine.py's rows) on the GPU. fp32 engine,
               TF32 off, against HF in float64 on the host: expected ~1e-6. bf16 engine
               (actor.precision=bf16) against the same reference, next to HF itself in bf16 on the
               GPU against it (the error bf16 costs anyway); both must stay under 5e-2. One bf16
               train_mini_batch: finite grad norm, the weights change. A forward-only engine (the
               reference policy) must hold its parameters on the GPU too.
  rollout_ipc  after one fp32 train step, the engine's exported weights (CUDA tensors) are packed into
               one flattened bucket in a CUDA buffer and serialised by megarl.wire.weights_codec,
               as bridge/tensor.py sends them; a spawned process builds the embedded rollout engine
               (megarl.rollout.engine.generation.GenerationEngine, cuda) from the untrained checkpoint and loads
               the bucket through update_weights_from_payloads (its HTTP route's call). Checked: every
               tensor bit-exact, and the rollout model's log-probs of the rows equal the trainer's.
  mfu_moe      train step and forward of megarl's engine (bf16) against a plain HF
               Qwen3MoeForCausalLM + torch.optim.AdamW (bf16 parameters) on the same weights and
               tokens, steps alternated (bench_engine.py's method), median of --steps after a warm-up.
  mfu_dense    the same for a dense Qwen3 of Qwen3-0.6B's shape.
  --ab-cu      in the mfu stages, also the engine with PackedSeqParams left on the host (not yet run
               on a GPU); --profile: one more step of each side under torch.profiler.
  --smoke      tiny widths, 2 x 64 tokens, one timed step: runs on a CPU-only machine too (gloo),
               to check the script itself in seconds.
The exit status is 1 when a stage failed (after the JSON and the table are written).

FLOPs model (per training step; forward only is a third of it):
  6 x active matmul parameters x tokens      (active: non-expert parameters + top_k / experts of the
                                              expert parameters; the input embedding is a lookup and
                                              is not counted, the output layer is, tied or not)
  + 12 x layers x heads x head_dim x seq x tokens / 2      (causal attention scores and values)
MFU = FLOPs / step time / 989e12 (H100 SXM bf16 dense peak, no sparsity). Both sides are credited the
same model FLOPs; neither's recompute or padding counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PEAK = 989e12
MOE = dict(
    vocab_size=32768,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=32,
    num_experts_per_tok=8,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)
DENSE = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: --smoke, to check this script cheaply
SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    vocab_size=512,
)
SMOKE_RUN = dict(rows=2, seq=64, dense_rows=2, dense_seq=64, steps=1)  # --smoke: batches and steps


def _init_dist() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        if DEVICE == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _engine(path: str, precision: str, train: bool, micro_batch_size: int = 2, lr: float = 1e-3):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    engine = MegatronEngine(
        EngineSpec(
            model_path=path,
            parallel=ParallelConfig(sequence_parallel=False),
            precision=precision,
            optim=OptimConfig(lr=lr, adam_eps=1e-2, clip_grad=0.0) if train else None,
            micro_batch_size=micro_batch_size,
            seed=1,
        )
    )
    engine.initialize()
    return engine


def _pg_loss(logp, ent, mb):
    from megarl.algo.losses import policy_loss

    m = mb["response_mask"]
    loss, _ = policy_loss(logp, logp.detach(), mb["advantages"], m, global_denominator=float(m.sum()))
    return loss, m.sum(), {}


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


def _hf_logprobs(model, device) -> torch.Tensor:
    """The rows' response log-probs from a HF model, row by row, as tests/engine/test_megatron_engine.py."""
    from tests.engine.test_megatron_engine import SEQ_ROWS, make_rows

    out = torch.zeros_like(make_rows()["response_mask"], dtype=torch.float64)
    with torch.no_grad():
        for i, (p, r) in enumerate(SEQ_ROWS):
            logp = torch.log_softmax(model(torch.tensor([p + r], device=device)).logits[0].double(), -1)
            for j, tok in enumerate(r):
                out[i, j] = logp[len(p) - 1 + j, tok].cpu()
    return out


def stage_parity(state: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from megarl.models.tiny import build_tiny_checkpoint
    from tests.engine.test_megatron_engine import hf_reference, make_rows

    _init_dist()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = str(build_tiny_checkpoint(os.path.join(state["tmp"], "tiny-qwen3-moe"), seed=0))
    state["tiny"] = path
    ref = hf_reference(path)  # float64, host
    rows = make_rows()
    mask = rows["response_mask"].bool()
    err = lambda x: float((x.double().cpu() - ref)[mask].abs().max())  # noqa: E731
    out = {}

    fp32 = _engine(path, "fp32", train=True)
    out["fp32_param_devices"] = sorted({str(p.device) for c in fp32.model for p in c.parameters()})
    out["fp32_err_vs_hf_fp64"] = err(fp32.compute_log_prob(rows)["log_probs"])
    metrics = fp32.train_mini_batch(rows, _pg_loss)
    out["fp32_grad_norm"] = metrics["actor/grad_norm"]
    state["fp32_engine"] = fp32
    state["fp32_after"] = fp32.compute_log_prob(rows)["log_probs"]

    bf16 = _engine(path, "bf16", train=True)
    out["bf16_param_dtypes"] = sorted({str(p.dtype) for c in bf16.model for p in c.parameters()})
    before = bf16.compute_log_prob(rows)["log_probs"]
    out["bf16_err_vs_hf_fp64"] = err(before)
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    out["hf_bf16_err_vs_hf_fp64"] = err(_hf_logprobs(hf16, DEVICE))
    del hf16
    w0 = {k: v.float().clone() for k, v in bf16.export_weights()}
    metrics = bf16.train_mini_batch(rows, _pg_loss)
    out["bf16_grad_norm"] = metrics["actor/grad_norm"]
    out["bf16_weights_max_change"] = max(float((v.float() - w0[k]).abs().max()) for k, v in bf16.export_weights())
    out["bf16_logprob_moved_by"] = float((bf16.compute_log_prob(rows)["log_probs"] - before)[mask].abs().max())
    del bf16, w0

    ref_engine = _engine(path, "bf16", train=False)
    out["forward_only_param_devices"] = sorted({str(p.device) for c in ref_engine.model for p in c.parameters()})
    del ref_engine
    on_device = ["cuda:0"] if DEVICE == "cuda" else ["cpu"]
    out["ok"] = (
        out["fp32_err_vs_hf_fp64"] < 1e-4
        and out["bf16_err_vs_hf_fp64"] < 5e-2
        and out["fp32_param_devices"] == on_device == out["forward_only_param_devices"]
        and out["bf16_param_dtypes"] == ["torch.bfloat16"]
        and out["bf16_grad_norm"] == out["bf16_grad_norm"]
        and out["bf16_weights_max_change"] > 0
    )
    return out


def _rollout_receiver(path: str, payload: str, expected_path: str, queue) -> None:
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        from megarl.rollout.engine.generation import GenerationEngine

        device = "cuda" if torch.cuda.is_available() else "cpu"
        engine = GenerationEngine(path, device=device, dtype="float32")
        try:
            message = engine.update_weights_from_payloads(
                [payload], load_format="flattened_bucket", weight_version="step-1"
            )
            expected = torch.load(expected_path)
            state = engine.model.state_dict()
            exact = {name: bool(torch.equal(state[name].cpu(), t)) for name, t in expected.items() if name in state}
            missing = sorted(set(expected) - set(state))
            queue.put(
                dict(
                    message=message,
                    exact=exact,
                    missing=missing,
                    devices=sorted({str(t.device) for t in state.values()}),
                    log_probs=_hf_logprobs(engine.model, device).tolist(),
                )
            )  # no tensor: it
            # would travel as a shared-memory handle that dies with this process
        finally:
            engine.close()
    except BaseException:  # reported to the parent
        queue.put({"error": traceback.format_exc()})


def stage_rollout_ipc(state: dict) -> dict:
    import torch.multiprocessing as mp

    from megarl.wire.weights_codec import flattened_bucket_nbytes, pack_flattened_bucket, serialize
    from tests.engine.test_megatron_engine import make_rows

    engine = state["fp32_engine"]  # trained one step by `parity`: its weights differ from the checkpoint's
    bucket = [(name, t) for name, t in engine.export_weights()]
    devices = sorted({str(t.device) for _, t in bucket})
    # bridge/tensor.py's buffer: one uint8 tensor on the parameters' device, packed and serialised
    buf = torch.empty(flattened_bucket_nbytes(bucket), dtype=torch.uint8, device=bucket[0][1].device)
    flat, metadata = pack_flattened_bucket(bucket, out=buf)
    payload = serialize({"flattened_tensor": flat, "metadata": metadata})
    expected_path = os.path.join(state["tmp"], "expected.pt")
    torch.save({n: t.cpu() for n, t in bucket}, expected_path)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_rollout_receiver, args=(state["tiny"], payload, expected_path, queue))
    proc.start()
    result = queue.get(timeout=300)  # `buf` stays alive in this process until the receiver replied
    proc.join(60)
    if "error" in result:
        raise RuntimeError("receiver failed:\n" + result["error"])
    mask = make_rows()["response_mask"].bool()
    diff = float((torch.tensor(result["log_probs"]) - state["fp32_after"].double())[mask].abs().max())
    return dict(
        sender_devices=devices,
        tensors=len(bucket),
        payload_chars=len(payload),
        bucket_mib=round(buf.numel() / 2**20, 2),
        receiver_devices=result["devices"],
        receiver_message=result["message"],
        bit_exact=all(result["exact"].values()),
        not_in_receiver=result["missing"],
        rollout_vs_trainer_logprob_max_abs=diff,
        ok=all(result["exact"].values()) and not result["missing"] and diff < 1e-4,
    )


def _flops(cfg, active_matmul: int, rows: int, seq: int) -> float:
    tokens = rows * seq
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq * tokens / 2
    return 6 * active_matmul * tokens + attn


def _active_matmul_params(model, cfg) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    ratio = cfg.num_experts_per_tok / cfg.num_experts if expert else 0.0
    embed = model.get_input_embeddings().weight.numel()
    output = model.get_output_embeddings().weight.numel()
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    matmul = total - expert + int(expert * ratio) - embed + (output if tied else 0)
    return total, matmul


def stage_mfu(state: dict, kind: str, args) -> dict:
    """megarl's engine (bf16) against HF + AdamW (bf16) on the same weights and tokens."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megarl.data.batch import Batch

    _init_dist()
    torch.backends.cuda.matmul.allow_tf32 = True
    config_cls, model_cls, shape = (
        (Qwen3MoeConfig, Qwen3MoeForCausalLM, MOE) if kind == "moe" else (Qwen3Config, Qwen3ForCausalLM, DENSE)
    )
    cfg = config_cls(**{**shape, **({k: v for k, v in SMOKE.items() if k in shape} if args.smoke else {})})
    torch.manual_seed(0)
    with torch.device(DEVICE):
        hf = model_cls(cfg)
    hf = hf.to(torch.bfloat16)
    path = os.path.join(state["tmp"], f"{kind}-bench")
    hf.save_pretrained(path)
    total, active = _active_matmul_params(hf, cfg)
    hf.train()
    rows, seq, prompt = (args.rows, args.seq, 16) if kind == "moe" else (args.dense_rows, args.dense_seq, 16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (rows, seq), generator=g)
    adv = torch.randn(rows, 1, generator=g).expand(rows, seq - prompt).contiguous()
    batch = Batch(
        {
            "input_ids": ids,
            "responses": ids[:, prompt:],
            "response_mask": torch.ones(rows, seq - prompt),
            "prompt_lengths": torch.full((rows,), prompt),
            "advantages": adv,
        }
    )
    t = time.perf_counter()
    engine = _engine(path, "bf16", train=True, micro_batch_size=rows, lr=1e-6)
    build_s = time.perf_counter() - t
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-6)
    gids, gadv = ids.to(DEVICE), adv.to(DEVICE)

    def hf_step():
        logits = hf(gids).logits.float()
        logp = torch.log_softmax(logits[:, prompt - 1 : -1], -1).gather(-1, gids[:, prompt:, None]).squeeze(-1)
        loss = -(torch.exp(logp - logp.detach()) * gadv).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def hf_forward():
        with torch.no_grad():
            logits = hf(gids).logits.float()
            torch.log_softmax(logits[:, prompt - 1 : -1], -1).gather(-1, gids[:, prompt:, None])

    def timed(fn):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        return time.perf_counter() - t

    grad_norms = []
    step = {
        "engine_train": lambda: grad_norms.append(engine.train_mini_batch(batch, _pg_loss)["actor/grad_norm"]),
        "hf_train": hf_step,
        "engine_fwd": lambda: engine.compute_log_prob(batch),
        "hf_fwd": hf_forward,
    }
    if args.ab_cu:  # the same engine with PackedSeqParams (cu_seqlens) left on the host
        step["cuhost_train"] = _cu_on_host(step["engine_train"])
        step["cuhost_fwd"] = _cu_on_host(step["engine_fwd"])
    times = {k: [] for k in step}
    for i in range(args.steps + 1):  # alternate, so drift hits both sides alike; the first is warm-up
        for k, fn in step.items():
            s = timed(fn)
            if i:
                times[k].append(s)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    flops = _flops(cfg, active, rows, seq)
    tokens = rows * seq
    out = dict(
        params_b=round(total / 1e9, 3),
        active_matmul_params_b=round(active / 1e9, 3),
        rows=rows,
        seq=seq,
        engine_build_s=round(build_s, 1),
        grad_norm_finite=all(x == x and abs(x) != float("inf") for x in grad_norms),
        peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1) if DEVICE == "cuda" else None,
        all_times_s={k: [round(x, 4) for x in v] for k, v in times.items()},
    )
    for k, s in med.items():
        f = flops if k.endswith("train") else flops / 3
        out[k] = dict(
            step_s=round(s, 4),
            tokens_per_s=round(tokens / s),
            tflops=round(f / s / 1e12, 1),
            mfu=round(f / s / PEAK, 4),
        )
    if args.ab_cu:
        out["cu_on_host_speedup_train"] = round(med["engine_train"] / med["cuhost_train"], 3)
        out["cu_on_host_speedup_fwd"] = round(med["engine_fwd"] / med["cuhost_fwd"], 3)
    out["train_ratio_engine_over_hf"] = round(med["hf_train"] / med["engine_train"], 3)
    out["fwd_ratio_engine_over_hf"] = round(med["hf_fwd"] / med["engine_fwd"], 3)
    if args.profile and DEVICE == "cuda":  # where each side's training step spends GPU time
        try:
            sides = {"engine": step["engine_train"], "hf": hf_step, "cuhost": step.get("cuhost_train")}
            out["profile"] = {side: _profile(fn) for side, fn in sides.items() if fn is not None}
        except Exception:  # the timings above stand without it
            out["profile"] = {"error": traceback.format_exc()[-2000:]}
    return out


def _cu_on_host(fn):
    """`fn` run with PackedSeqParams left on the host (an A/B of inputs.inputs_to). The local spec
    reads cu_seqlens as Python numbers in every layer (CpuCoreAttention's per-sequence loop,
    megatron's unfused THD RoPE: .tolist() / .item() for q and k); on the GPU each read is a sync.
    Not yet run on a GPU (the lease ended first): see RESULTS.md."""
    from megarl.engine.megatron import inputs as inputs_module

    def inputs_to(x, device, original=inputs_module.inputs_to):
        return {**original(x, device), "packed_seq_params": x.get("packed_seq_params")}

    def run():
        original = inputs_module.inputs_to
        inputs_module.inputs_to = inputs_to
        try:
            fn()
        finally:
            inputs_module.inputs_to = original

    return run


def _profile(fn) -> dict:
    """One more step under torch.profiler: GPU busy time, and the kernels that take the most of it."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    wall = time.perf_counter() - t
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    busy = sum(e.device_time_total for e in events) / 1e6
    top = sorted(events, key=lambda e: -e.device_time_total)[:12]
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    calls = {e.key: e.count for e in prof.key_averages()}
    return dict(
        wall_s=round(wall, 4),
        kernel_s=round(busy, 4),
        kernel_launches=sum(e.count for e in events),
        syncs={
            k: calls.get(k, 0)
            for k in (
                "aten::_local_scalar_dense",
                "cudaStreamSynchronize",
                "cudaDeviceSynchronize",
                "cudaMemcpyAsync",
                "aten::nonzero",
            )
        },
        top=[(e.key[:90], e.count, round(e.device_time_total / 1e6, 4)) for e in top],
        top_host=[(e.key[:90], e.count, round(e.self_cpu_time_total / 1e6, 4)) for e in host],
    )


def table(results: dict) -> str:
    lines = ["| model | side | train tok/s | train MFU | fwd tok/s | fwd MFU |", "|---|---|---|---|---|---|"]
    for kind in ("mfu_moe", "mfu_dense"):
        r = results.get(kind, {})
        if not r.get("ok"):
            lines.append(f"| {kind} | - | {'failed' if kind in results else 'not run'} | | | |")
            continue
        for side in ("engine", "hf"):
            tr, fw = r[f"{side}_train"], r[f"{side}_fwd"]
            lines.append(
                f"| {kind[4:]} {r['params_b']}B ({r['active_matmul_params_b']}B active), "
                f"{r['rows']}x{r['seq']} | {side} | {tr['tokens_per_s']} | {tr['mfu']:.1%} | "
                f"{fw['tokens_per_s']} | {fw['mfu']:.1%} |"
            )
        lines.append(f"| | engine / hf | {r['train_ratio_engine_over_hf']}x | | {r['fwd_ratio_engine_over_hf']}x | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="where bench_gpu.json goes (default: .; --smoke: a temp dir)")
    ap.add_argument("--stages", default="env,parity,rollout_ipc,mfu_moe,mfu_dense")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dense-rows", type=int, default=4)
    ap.add_argument("--dense-seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ab-cu", action="store_true", help="also time the engine with cu_seqlens kept on the host")
    ap.add_argument("--profile", action="store_true", help="profile one more train step of each side")
    ap.add_argument("--smoke", action="store_true", help="tiny widths and batches (a CPU check of the script itself)")
    args = ap.parse_args()
    args.out = args.out or (tempfile.mkdtemp(prefix="bench_gpu_smoke_") if args.smoke else ".")
    if args.smoke:  # smoke sizes replace the defaults only: flags given explicitly still win
        for key, value in SMOKE_RUN.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        state = {"tmp": tmp}
        stages = {
            "env": stage_env,
            "parity": lambda: stage_parity(state),
            "rollout_ipc": lambda: stage_rollout_ipc(state),
            "mfu_moe": lambda: stage_mfu(state, "moe", args),
            "mfu_dense": lambda: stage_mfu(state, "dense", args),
        }
        for name in args.stages.split(","):
            t = time.perf_counter()
            try:
                results[name] = {"ok": True, **stages[name]()}
            except BaseException:
                results[name] = {"ok": False, "error": traceback.format_exc()[-6000:]}
            results[name]["wall_s"] = round(time.perf_counter() - t, 1)
            print(name, json.dumps(results[name], indent=1), flush=True)
            gc.collect()  # the stage's models go before the next one builds its own
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
                json.dump(results, f, indent=1)
    print(table(results), flush=True)
    failed = [name for name, r in results.items() if not r.get("ok")]
    if failed:
        sys.exit(f"bench_gpu: failed stages: {', '.join(failed)} (tracebacks above and in bench_gpu.json)")


if __name__ == "__main__":
    main()
