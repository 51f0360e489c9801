"""Memory per device of a run's layout, predicted from the config and the model's HF config.

Pure arithmetic over megarl's own layouts (what megarl/engine/megatron builds and what SGLang or the
embedded engine holds); the planner (megarl/perf/plan.py) puts the phases of a step together.

Training rank (Megatron, worst pipeline stage):
- parameters: the stage's layers, attention / dense MLP / shared experts over tp, routed experts
  over ep (then etp), norms, biases, router and MLA's down-projections replicated; the embedding
  on the first stage and the output layer on the last (a tied embedding is on both when pp > 1);
  2 bytes each in bf16, 4 in fp32.
- gradients: Megatron's contiguous buffer in fp32 (grad_reduce_in_fp32), 4 bytes per parameter,
  never sharded (the distributed optimizer reduce-scatters into it).
- optimizer: Adam's two moments in fp32 (8 bytes) plus the fp32 master copy in bf16 (4), sharded
  by the distributed optimizer over the data-parallel ranks (dp*cp for dense parameters, the
  expert data-parallel ranks for experts). actor.offload.host_optimizer = f keeps (1 - f) of it
  on the device: Megatron's hybrid optimizer (engine/megatron/optimizer.py) holds the fp32 master
  weights and moments of its host share there, and the distributed optimizer keeps no master
  copy of its own. The host holds 16 bytes per parameter of that share: master 4, moments 8 and
  the fp32 gradient it copies in before each step, 4 (TrainMemory.host_optimizer, per rank).
- activations: what backward keeps, per token and layer, in the training dtype (Korthikanti et al.
  2022's accounting, with flash attention on GPUs, i.e. no score matrix; the CPU engine's attention
  keeps scores and probabilities, L x L per head). Sequence parallel divides the norm / residual
  parts by tp; context parallel divides the tokens by cp; full recompute keeps only each layer's
  input plus one layer's activations at a time; selective recompute (Megatron's core_attn) saves
  nothing measurable with flash attention and is counted as none. A pipeline stage keeps
  min(micro-batches, pp - stage) micro-batches in flight (1F1B), interleaved schedules their
  warm-up chunks. The last stage also holds the log-prob head's buffers
  (engine/megatron/logprob.py, the output layer fused in): two fp32 [chunk, vocab / tp] work
  buffers of CHUNK_BYTES each and, in bf16, one [chunk, vocab / tp] chunk in the model's dtype;
  plus, where actor.logits_memory keeps the logits for backward ("keep", or "auto" while they fit
  KEEP_LOGITS_BYTES), the micro-batch's [tokens, vocab / tp] in the model's dtype. The unfused head
  this replaced held 18 bytes per token and vocab entry / tp (bf16 logits, their fp32 copy and three
  fp32 intermediates; measured on an H100, benchmarks/bench_gpu_plan.py).
- a runtime reserve per process (hardware.py): context, communication buffers, fragmentation.
- with actor.lora, gradients and optimizer state are the adapters' only (perf/lora.py); the
  parameters are the base's plus theirs, and the reference policy costs nothing (it is the
  actor's base with the adapters off).

Rollout device: the engine's weights (attention over tp / dp with DP attention, MLP and experts
over tp, vocabulary over tp), its KV cache (2 * kv_heads * head_dim per layer and token, heads over
the attention ranks, replicated when fewer than them; MLA: the compressed latent + rope key,
replicated over the attention ranks). SGLang reserves mem_fraction_static of the device for
weights + KV cache; the rest is its runtime (activations, CUDA graphs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megarl.perf.flops import _as_dict, layer_params
from megarl.perf.hardware import Device
from megarl.perf.lora import lora_stage_params

# SGLang picks mem_fraction_static by tp size and GPU memory (0.79-0.88 on 80 GB cards); the
# planner assumes this when rollout.mem_fraction_static is not set
SGLANG_DEFAULT_MEM_FRACTION = 0.85
# the log-prob head's sizes (engine/megatron/logprob.py's CHUNK_BYTES and KEEP_LOGITS_BYTES, which
# tests/perf/test_memory_head.py holds these to): one fp32 [chunk, vocab / tp] work buffer, and
# the kept logits up to which actor.logits_memory "auto" keeps them
HEAD_CHUNK_BYTES = 128 * 2**20
HEAD_KEEP_LOGITS_BYTES = 2 * 2**30


def head_bytes(tokens: float, vocab_local: float, bf16: bool, logits_memory: str = "auto") -> float:
    """Bytes the fused log-prob head holds in training on a last-stage rank for a micro-batch of
    `tokens`: two fp32 work buffers of a chunk each (a whole micro-batch when it is smaller), the
    chunk in the model's dtype when that is not fp32, and the kept logits where they are kept."""
    dtype = 2 if bf16 else 4
    chunk = max(1.0, min(tokens, HEAD_CHUNK_BYTES // (4 * vocab_local)))
    work = 2 * chunk * vocab_local * 4 + (chunk * vocab_local * dtype if bf16 else 0)
    kept = tokens * vocab_local * dtype
    keep = logits_memory == "keep" or (logits_memory == "auto" and kept <= HEAD_KEEP_LOGITS_BYTES)
    return work + (kept if keep else 0.0)


# per parameter of the host optimizer's share, on the host: fp32 master, two fp32 moments, the
# fp32 gradient copied from the device before the step
HOST_OPTIMIZER_BYTES = 16


@dataclass(frozen=True)
class StageParams:
    dense: float  # parameters of one rank of this stage sharded with the data-parallel group
    expert: float  # routed-expert parameters of one rank (sharded with the expert data-parallel group)
    layers: range


def stage_params(hf: dict, p, value_head: bool = False) -> list[StageParams]:
    """Parameters per rank of each pipeline stage of layout `p` (a ParallelConfig)."""
    from megarl.config.validate_pipeline import stage_layers

    hf = _as_dict(hf)
    h, vocab, n_layers = hf["hidden_size"], hf["vocab_size"], hf["num_hidden_layers"]
    tied = bool(hf.get("tie_word_embeddings", False)) and not value_head
    out, start = [], 0
    for s, n in enumerate(stage_layers(p, n_layers)):
        dense = expert = 0.0
        for i in range(start, start + n):
            lp = layer_params(hf, i)
            dense += (lp.attn + lp.mlp) / p.tp + lp.replicated
            if lp.experts:
                expert += lp.experts / p.ep * lp.expert / p.etp
        if s == 0:
            dense += vocab * h / p.tp
        if s == p.pp - 1:
            dense += h + (h if value_head else (0 if tied and p.pp == 1 else vocab * h / p.tp))
        out.append(StageParams(dense, expert, range(start, start + n)))
        start += n
    return out


def activation_elements_per_token(hf: dict, i: int, tp: int, sp: bool) -> float:
    """Elements layer i keeps for backward per token of a micro-batch, on one tensor-parallel rank."""
    hf = _as_dict(hf)
    h, s = hf["hidden_size"], (tp if sp else 1)
    lp = layer_params(hf, i)
    n = hf["num_attention_heads"]
    if hf["model_type"] == "deepseek_v3":
        qr, kvr, rope = hf.get("q_lora_rank") or 0, hf["kv_lora_rank"], hf["qk_rope_head_dim"]
        qk, v = hf["qk_nope_head_dim"] + rope, hf["v_head_dim"]
        attn = 2 * h / s + 2 * qr + 2 * kvr + rope + n * (qk + (qk - rope + v) + qk + v + v) / tp
    else:
        hd = hf.get("head_dim") or h // n
        kvh = hf.get("num_key_value_heads") or n
        q, kv = n * hd, 2 * kvh * hd
        kv_local = kv / min(tp, kvh)
        attn = 2 * h / s + q / tp + kv_local + q / tp
        if hf["model_type"] in ("qwen3", "qwen3_moe"):  # q/k norms keep their inputs
            attn += q / tp + kv_local / 2
    if not lp.experts:
        f = lp.mlp / (3 * h)
        return attn + 2 * h / s + 3 * f / tp
    k, fe = hf["num_experts_per_tok"], lp.expert / (3 * h)
    router = 2 * 2 * lp.experts / s  # fp32 logits and probabilities, counted in 2-byte units
    routed = k * (2 * h + 3 * fe) / s  # per routed copy: permuted input, gate/up/act, expert output
    shared = 3 * (lp.mlp / (3 * h)) / tp
    return attn + 2 * h / s + router + routed + shared


@dataclass(frozen=True)
class TrainMemory:
    stage: int  # the pipeline stage with the largest peak
    params: float
    grads: float
    optimizer: float
    activations: float  # micro-batches in flight, all layers of the stage
    logits: float
    reserve: float
    in_flight: float  # micro-batches whose activations the stage keeps
    tokens: int  # tokens of one micro-batch
    # host memory of the host optimizer's share per rank, on the stage that needs the most
    host_optimizer: float = 0.0

    @property
    def static(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        return self.static + self.activations + self.logits + self.reserve

    def resident(self, offload) -> float:
        """What stays on the device between calls (offload config: params / grads / optimizer)."""
        return (
            (0 if offload.params else self.params)
            + (0 if offload.grads else self.grads)
            + (0 if offload.optimizer else self.optimizer)
            + self.reserve
        )


def micro_batch_tokens(cfg, section: str = "actor") -> int:
    """Tokens one micro-batch holds at the longest rows (prompt + response at their limits)."""
    sec = getattr(cfg, section)
    row = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    budget = getattr(sec, "max_tokens_per_micro_batch", None)
    if budget:
        return max(int(budget), row)
    return sec.micro_batch_size * row


def micro_batches_per_rank(cfg, section: str = "actor") -> int:
    sec, p = getattr(cfg, section), getattr(cfg, section).parallel
    dp = max(cfg.cluster.num_actor_ranks // (p.tp * p.pp * p.cp), 1)
    rows = getattr(sec, "ppo_mini_batch_size", None) or sec.mini_batch_size  # the PRM's has no ppo_
    rows //= dp
    row = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    return max(1, math.ceil(rows * row / micro_batch_tokens(cfg, section)))


def in_flight(p, stage: int, micro_batches: int) -> float:
    """Micro-batches (in units of the stage's whole layers) whose activations the stage keeps."""
    if p.vpp <= 1:
        return min(micro_batches, p.pp - stage)
    chunks = min(micro_batches * p.vpp, (p.pp - stage - 1) * 2 + (p.vpp - 1) * p.pp + 1)
    return chunks / p.vpp


def train_memory(cfg, hf: dict, device: Device, section: str = "actor") -> TrainMemory:
    """Peak memory of one training rank (actor, critic or prm) of `cfg` on `device`."""
    sec = getattr(cfg, section)
    p = sec.parallel
    world = cfg.cluster.num_actor_ranks
    bf16 = getattr(sec, "precision", cfg.actor.precision) == "bf16"
    pbytes, abytes = (2, 2) if bf16 else (4, 4)
    opt_bytes = 8 + (4 if bf16 else 0)
    dist = sec.optim.use_distributed_optimizer
    host_share = getattr(sec.offload, "host_optimizer", 0.0)
    dp_dense = max(world // (p.tp * p.pp), 1)  # dp * cp: Megatron shards dense state over both
    dp_expert = max(world // (p.ep * p.etp * p.pp), 1)
    recompute = getattr(sec, "recompute", "none")
    sp = bool(p.sequence_parallel) if p.sequence_parallel is not None else p.tp > 1
    tokens = micro_batch_tokens(cfg, section)
    local = tokens / p.cp
    m = micro_batches_per_rank(cfg, section)
    row = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    best, most_host = None, 0.0
    stages = stage_params(hf, p, value_head=section == "critic")
    lora = getattr(sec, "lora", None)
    adapters = lora_stage_params(hf, p, lora) if lora is not None and lora.rank else None
    for s, st in enumerate(stages):
        params = (st.dense + st.expert) * pbytes
        if adapters is not None:  # LoRA: the frozen base has no gradient or optimizer state
            params += sum(adapters[s]) * pbytes
            st = replace(st, dense=adapters[s][0], expert=adapters[s][1])
        grads = (st.dense + st.expert) * 4
        state = (st.dense / dp_dense + st.expert / dp_expert) if dist else st.dense + st.expert
        optimizer = opt_bytes * state * (1 - host_share)
        per_layer = [activation_elements_per_token(hf, i, p.tp, sp) * local * abytes for i in st.layers]
        if device.name == "CPU":  # unfused attention keeps scores and probabilities per head
            heads = _as_dict(hf)["num_attention_heads"] / p.tp
            scores = heads * row * row / p.cp * 2 * abytes * (tokens // row)
            per_layer = [a + scores for a in per_layer]
        if recompute == "full":
            h = _as_dict(hf)["hidden_size"] / (p.tp if sp else 1)
            layer_acts = len(per_layer) * h * local * abytes  # each layer's input only
        else:
            layer_acts = sum(per_layer)
        flight = in_flight(p, s, m)
        acts = layer_acts * flight + (max(per_layer, default=0.0) if recompute == "full" else 0.0)
        logits = 0.0
        if s == p.pp - 1 and section != "critic":
            vocab_local = _as_dict(hf)["vocab_size"] / p.tp
            logits = head_bytes(local, vocab_local, bf16, getattr(sec, "logits_memory", "auto"))
        most_host = max(most_host, HOST_OPTIMIZER_BYTES * state * host_share)
        mem = TrainMemory(s, params, grads, optimizer, acts, logits, device.runtime_reserve, flight, tokens)
        if best is None or mem.peak > best.peak:
            best = mem
    return replace(best, host_optimizer=most_host)


def reference_params_bytes(cfg, hf: dict) -> float:
    """A forward-only reference rank: the actor's layout, parameters only. With LoRA none: the
    reference is the actor's own frozen base, its adapters switched off."""
    if cfg.actor.lora.rank:
        return 0.0
    p = cfg.actor.parallel
    pbytes = 2 if cfg.actor.precision == "bf16" else 4
    return max((s.dense + s.expert) * pbytes for s in stage_params(hf, p))


@dataclass(frozen=True)
class RolloutMemory:
    weights: float  # per device
    kv_per_token: float  # bytes per token of one sequence, on each device that holds it
    pool: float  # weights + KV cache budget per device
    kv_capacity: int  # tokens the engine's KV cache holds (all its devices)
    kv_needed: int  # tokens for the engine's concurrent sequences at full length
    reserve: float  # the engine process's runtime outside the pool

    @property
    def peak(self) -> float:
        return self.pool + self.reserve


def rollout_memory(cfg, hf: dict, device: Device) -> RolloutMemory:
    hf = _as_dict(hf)
    r = cfg.rollout
    attn_tp = max(r.tp // r.dp, 1)
    wbytes = 2 if (r.backend == "sglang" or cfg.actor.precision == "bf16") else 4
    h, vocab = hf["hidden_size"], hf["vocab_size"]
    tied = bool(hf.get("tie_word_embeddings", False))
    weights = vocab * h * (1 if tied else 2) / r.tp + h
    for i in range(hf["num_hidden_layers"]):
        lp = layer_params(hf, i)
        weights += lp.attn / attn_tp + lp.mlp / r.tp + lp.replicated + lp.experts * lp.expert / r.tp
    weights *= wbytes
    layers = hf["num_hidden_layers"]
    if hf["model_type"] == "deepseek_v3":
        kv = layers * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * wbytes
    else:
        n = hf["num_attention_heads"]
        kvh = hf.get("num_key_value_heads") or n
        hd = hf.get("head_dim") or h // n
        kv = layers * 2 * math.ceil(kvh / attn_tp) * hd * wbytes
    rows = cfg.data.train_batch_size * r.n
    per_engine = math.ceil(rows / r.num_servers)
    concurrent = min(r.max_batch_size, per_engine)
    needed = concurrent * (cfg.data.max_prompt_length + r.max_new_tokens)
    if r.backend == "sglang":
        frac = getattr(r, "mem_fraction_static", None) or SGLANG_DEFAULT_MEM_FRACTION
        pool = frac * device.memory
        capacity = int(max(pool - weights, 0) / kv) * r.dp
    else:  # the embedded engine allocates the cache its batch needs
        pool = weights + kv * needed / r.dp
        capacity = needed
    return RolloutMemory(weights, kv, pool, capacity, needed, device.runtime_reserve)
