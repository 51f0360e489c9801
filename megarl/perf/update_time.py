"""The trainer's side of a step, predicted: the actor update and the log-prob passes.

update: 3x forward FLOPs (4x with full recompute: the hardware does the extra forward, MFU does
not count it) at the GEMM efficiency, scaled by

- the slowest pipeline stage (`stage_imbalance`): a stage's forward FLOPs are its layers' plus,
  on the last stage, the output layer's; an uneven split (first/last_stage_layers) or a large
  vocabulary makes one stage slower than the mean, and every stage waits for it;
- the busiest expert rank (`moe_imbalance`): each MoE layer waits for the expert-parallel rank
  that received the most routed tokens; its expected excess over the mean follows from the
  routing statistics (below), and it slows the routed-expert share of the FLOPs and the
  all-to-all alike;

then the pipeline bubble (pp - 1) / (vpp * micro-batches) of the slowest stage's time (interleaved
1F1B, Narayanan et al. 2021), the point-to-point traffic between stages (vpp times per
micro-batch and direction: interleaving multiplies it), MoE all-to-all (dispatch + combine per MoE
layer over the expert group ep * etp; per routed copy, or with node-level dispatch once per
destination node its experts sit on: `a2a_copies`), sequence-parallel gathers/scatters, context parallel's ring
of key/value chunks, the data-parallel gradient reduce-scatter and parameter all-gather per
optimizer step, the optimizer step on the device or on the host (CPU Adam), and the offload
traffic over PCIe. Communication that the engine overlaps with compute is charged only beyond
what the compute can hide (`exposed`).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import replace

from megarl.perf.flops import _as_dict, attention_flops_per_pair, count_params, layer_params
from megarl.perf.hardware import Device


def _moe_layers(hf: dict) -> tuple[int, int, int]:
    """(MoE layers, experts, top-k)."""
    n, experts = 0, 0
    for i in range(hf["num_hidden_layers"]):
        lp = layer_params(hf, i)
        if lp.experts:
            n, experts = n + 1, lp.experts
    return n, experts, hf.get("num_experts_per_tok") or 0


def _tokens(cfg, mean_response: float) -> float:
    return cfg.data.train_batch_size * cfg.rollout.n * (cfg.data.max_prompt_length + mean_response)


def _forward_parts(hf: dict, rows: int, length: float) -> tuple[float, float]:
    """(linear layers', attention core's) forward FLOPs of `rows` rows of `length` tokens."""
    c = count_params(hf)
    return rows * 2 * c.matmul_active * length, rows * attention_flops_per_pair(hf) * length * (length + 1) / 2


def _forward_flops(hf: dict, rows: int, length: float) -> float:
    return sum(_forward_parts(hf, rows, length))


def forward_seconds(cfg, hf: dict, device: Device, rows: int, length: float, eff) -> float:
    """Device-seconds of one forward over `rows` rows: the GEMMs at the GEMM efficiency, and the
    memory-bound elementwise work between them (elementwise_seconds). A run whose GEMMs are FP8
    (eff.fp8_gemms: a published run's precision, never megarl's own) prices its linear layers at
    the device's FP8 dense peak times eff.gemm_fp8; FP8 recipes (Transformer Engine's) keep the
    attention core in bf16, so that part stays at the bf16 rate."""
    linear, attention = _forward_parts(hf, rows, length)
    rate = device.peak_flops(_dtype(cfg, device)) * eff.gemm
    streamed = elementwise_seconds(cfg, hf, device, rows * length)
    if not getattr(eff, "fp8_gemms", False):
        return (linear + attention) / rate + streamed
    return linear / (device.peak_flops("fp8") * eff.gemm_fp8) + attention / rate + streamed


# memory-bound elementwise kernels (norms, residual adds, activations, token permutation) stream
# at this fraction of the device's memory bandwidth (a large copy reaches ~90% on H100; launches,
# small tensors and the allocator take the rest). Stated, not fitted
ELEMENTWISE_BW = 0.8


@functools.lru_cache(maxsize=64)
def _elementwise_elements(hf_json: str) -> float:
    """Activation elements a token's forward reads or writes outside the GEMMs and the attention
    core, all layers: two norms (read + write: 4h) and two residual adds (two reads, a write: 6h)
    a layer; a dense gated MLP's activation (reads gate and up, writes their product: 3 x ffn); an
    MoE layer's per routed copy (k of them): the activation (3 x ffn), the permutation into expert
    order (read + write: 2h) and the weighted combine back (a read per copy, a write: kh + h), and
    its shared experts' activations."""
    hf = json.loads(hf_json)
    h, k = hf["hidden_size"], hf.get("num_experts_per_tok") or 0
    total = 0.0
    for i in range(hf["num_hidden_layers"]):
        lp = layer_params(hf, i)
        total += 10 * h
        if lp.experts:
            ffn = hf["moe_intermediate_size"]
            total += k * (3 * ffn + 3 * h) + h + 3 * ffn * (hf.get("n_shared_experts") or 0)
        else:
            total += 3 * hf["intermediate_size"]
    return total


def elementwise_seconds(cfg, hf: dict, device: Device, tokens: float) -> float:
    """Device-seconds of one forward's elementwise work over `tokens` tokens (_elementwise_elements,
    at the activations' width, streamed at ELEMENTWISE_BW of the memory bandwidth). A backward
    moves about twice a forward's bytes (the incoming gradient and the saved input read, the
    outgoing gradient written), as its GEMMs do twice the FLOPs, so the update's pass count
    applies to both. Small hidden sizes make it a larger share: on H100 in bf16 Qwen3-30B-A3B's
    is ~30% of its GEMM time, DeepSeek-V3's ~10%."""
    width = 2 if _dtype(cfg, device) == "bf16" else 4
    return tokens * _elementwise_elements(_key(hf)) * width / (device.hbm_bw * ELEMENTWISE_BW)


def _dtype(cfg, device: Device) -> str:
    return "bf16" if cfg.actor.precision == "bf16" and device.name != "CPU" else "fp32"


def _kv_elements(hf: dict) -> int:
    """Key and value elements per token, all heads (MLA: after the up-projection, as attention sees them)."""
    n = hf["num_attention_heads"]
    if hf["model_type"] == "deepseek_v3":
        return n * (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"] + hf["v_head_dim"])
    hd = hf.get("head_dim") or hf["hidden_size"] // n
    return 2 * (hf.get("num_key_value_heads") or n) * hd


def _bubble(p, micro_batches: int) -> float:
    """Idle fraction of interleaved 1F1B: pp - 1 warm-up / cool-down slots of 1 / vpp micro-batch each."""
    return (p.pp - 1) / (p.vpp * max(micro_batches, 1))


def exposed(comm: float, compute: float, fraction: float) -> float:
    """What is left of `comm` seconds on the critical path when a `fraction` of it can run under
    `compute` seconds of work (fraction 0: all of it; 1: only what outlasts the compute)."""
    return comm - min(fraction * comm, compute)


def _layer_flops_per_token(hf: dict, i: int, length: float) -> float:
    lp = layer_params(hf, i)
    k = hf.get("num_experts_per_tok") or 0
    matmul = lp.attn + lp.mlp + lp.replicated + (k * lp.expert if lp.experts else 0)
    return 2 * matmul + attention_flops_per_pair(hf) / hf["num_hidden_layers"] * (length + 1) / 2


@functools.lru_cache(maxsize=256)
def _per_layer(hf_json: str, length: float) -> tuple[tuple[float, ...], float]:
    """(forward FLOPs per token of each layer, the routed experts' share of a token's FLOPs);
    cached: the layout search asks for the same model and length thousands of times."""
    hf = json.loads(hf_json)
    per = tuple(_layer_flops_per_token(hf, i, length) for i in range(hf["num_hidden_layers"]))
    k = hf.get("num_experts_per_tok") or 0
    routed = 0.0
    for i in range(hf["num_hidden_layers"]):
        lp = layer_params(hf, i)
        routed += 2 * k * lp.expert if lp.experts else 0
    c = count_params(hf)
    return per, routed / (2 * c.matmul_active + attention_flops_per_pair(hf) * (length + 1) / 2)


def _key(hf: dict) -> str:
    return json.dumps(hf, sort_keys=True, default=str)


def stage_imbalance(p, hf: dict, length: float) -> float:
    """pp x the slowest stage's forward FLOPs over all stages' (1: balanced). The output layer
    (2 * vocab * hidden per token) sits on the last stage; an uneven split moves layers off it."""
    if p.pp <= 1:
        return 1.0
    from megarl.config.validate_pipeline import stage_layers

    per, _ = _per_layer(_key(hf), float(length))
    stages, start = [], 0
    for n in stage_layers(replace(p, vpp=1), hf["num_hidden_layers"]):  # a rank's layers, all its chunks
        stages.append(sum(per[start : start + n]))
        start += n
    stages[-1] += 2 * hf["vocab_size"] * hf["hidden_size"]
    return p.pp * max(stages) / sum(stages)


def moe_imbalance(hf: dict, local_tokens: float, ep: int, cv: float) -> float:
    """Expected load of the busiest of `ep` expert ranks over the mean, per MoE layer.

    Each of the group's ranks routes its `local_tokens` to top-k of E experts, E / ep per rank, so
    a rank receives local_tokens * k routed copies on average. Per expert, the load varies by
    sampling (Poisson: variance = mean) and by the router's own skew, a coefficient of variation
    `cv` of the expert loads that an auxiliary-loss-balanced router leaves; a rank sums E / ep
    independent experts, so its load's coefficient of variation is
    sqrt(1 / (local_tokens * k) + cv^2 * ep / E), and the largest of ep such loads exceeds the mean
    by about sqrt(2 ln ep) of them (the normal maximum). cv = 0 is a forced-balanced router
    (Megatron's moe_router_force_load_balancing): every rank gets exactly its share."""
    n, experts, k = _moe_layers(hf)
    if not n or ep <= 1 or cv <= 0:
        return 1.0
    spread = math.sqrt(1 / max(local_tokens * k, 1.0) + cv**2 * ep / experts)
    return 1 + spread * math.sqrt(2 * math.log(ep))


def compute_scale(cfg, hf: dict, length: float, local_tokens: float, eff) -> tuple[float, float]:
    """(factor on the GEMM time, the MoE imbalance): the slowest pipeline stage, and the routed
    experts' share slowed by the busiest expert rank."""
    p = cfg.actor.parallel
    imbalance = moe_imbalance(hf, local_tokens, p.ep, getattr(eff, "routing_cv", 0.0))
    share = _per_layer(_key(hf), float(length))[1] if imbalance > 1 else 0.0
    return stage_imbalance(p, hf, length) * (1 + share * (imbalance - 1)), imbalance


def optimizer_time(cfg, hf: dict, device: Device, train_mem, eff, steps: int) -> float:
    """The optimizer steps of an update. On the device Adam streams its state through HBM. With
    actor.offload.host_optimizer = f (Megatron's optimizer_cpu_offload with offload fraction f; verl
    and slime run f = 1, CPU Adam) that fraction of the rank's shard is updated on the host: its
    fp32 gradients go down and its bf16 parameters come back over PCIe, and the host steps Adam at
    eff.host_adam_params_s parameters a second per device (its share of the node's cores and
    memory bandwidth). The shard is counted from the layout, not from train_mem.optimizer, which
    the memory model may already have reduced by f."""
    from megarl.perf.memory import stage_params

    a, p = cfg.actor, cfg.actor.parallel
    f = min(max(float(getattr(a.offload, "host_optimizer", 0.0) or 0.0), 0.0), 1.0)
    world = cfg.cluster.num_actor_ranks
    st = stage_params(hf, replace(p, vpp=1))[train_mem.stage]
    if a.optim.use_distributed_optimizer:
        shard = st.dense / max(world // (p.tp * p.pp), 1) + st.expert / max(world // (p.ep * p.etp * p.pp), 1)
    else:
        shard = st.dense + st.expert
    state_bytes = 12 if a.precision == "bf16" else 8  # Adam moments (+ fp32 master weights)
    on_device = (1 - f) * shard * state_bytes * 2 + train_mem.grads
    pbytes = 2 if a.precision == "bf16" else 4
    on_host = f * shard * ((4 + pbytes) / (device.pcie_bw * eff.link) + 1 / eff.host_adam_params_s)
    return steps * (on_device / device.hbm_bw + on_host)


def remote_nodes(hf: dict, group: int, on_node: int) -> float:
    """The expected number of other nodes one token's routed copies land on, out of the `group`
    expert ranks spread `on_node` to a node (experts in order on the ranks, a node holding a
    contiguous block of them). The router picks topk_group of n_group expert groups (DeepSeek-V3's
    group-limited routing; ungrouped: one group, all experts), then k distinct experts among the
    chosen groups'; both picks are taken as uniform (a balanced router). A node is missed when the
    chosen groups leave it no expert or the k picks avoid the experts it holds; by symmetry every
    node is hit with the same probability, so the expected count is (nodes - 1) x P(hit)."""
    k = hf.get("num_experts_per_tok") or 0
    experts = _moe_layers(hf)[1]
    nodes = max(1, math.ceil(group / max(on_node, 1)))
    if nodes <= 1 or not k or not experts:
        return 0.0
    n_group, topk_group = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if topk_group >= n_group:
        n_group = topk_group = 1
    per_group, per_node = experts / n_group, experts / nodes
    # the groups node 0 overlaps, and how many of its experts sit in each
    overlap = [min(per_node, (g + 1) * per_group) - g * per_group for g in range(n_group) if g * per_group < per_node]
    candidates = round(topk_group * per_group)
    miss = 0.0
    for chosen in itertools.product((0, 1), repeat=len(overlap)):
        t = sum(chosen)
        if t > topk_group:
            continue
        p_groups = math.comb(n_group - len(overlap), topk_group - t) / math.comb(n_group, topk_group)
        held = round(sum(o for o, c in zip(overlap, chosen) if c))
        miss += p_groups * math.comb(candidates - held, k) / math.comb(candidates, k)
    return (nodes - 1) * (1 - miss)


def a2a_copies(hf: dict, group: int, on_node: int, node_dispatch: bool) -> tuple[float, float]:
    """(copies over NVLink, copies over the network) a rank sends per routed token, each way.
    Per routed copy (Megatron's alltoall dispatcher): k copies spread evenly over the group's
    ranks, those on the rank's node over NVLink, the rest over the network. Node-level dispatch
    (DeepEP): a token crosses the network once per remote node its experts sit on (remote_nodes,
    on average) and fans out to its experts' ranks over that node's NVLink."""
    k = hf.get("num_experts_per_tok") or 0
    if not node_dispatch or group <= on_node:
        return k * (on_node - 1) / group, k * (group - on_node) / group
    return k * (on_node - 1) / on_node, remote_nodes(hf, group, on_node)


def _link(device: Device, group_fits_node: bool, eff) -> float:
    return (device.nvlink_bw if group_fits_node else device.net_bw) * eff.link


def comm_time(
    cfg, hf: dict, device: Device, tokens_rank: float, per_node: int, eff, imbalance: float
) -> tuple[float, float]:
    """(expert all-to-all seconds, other tensor / context / pipeline traffic seconds) of an update."""
    a, p = cfg.actor, cfg.actor.parallel
    world = cfg.cluster.num_actor_ranks
    passes = 3 if getattr(a, "recompute", "none") == "full" else 2
    moe_layers = _moe_layers(hf)[0]
    h, layers = hf["hidden_size"], hf["num_hidden_layers"]
    abytes = 2 if a.precision == "bf16" else 4
    a2a = other = 0.0
    group = p.ep * p.etp  # routed tokens travel over the expert group: all-to-all over ep, gathers over etp
    if moe_layers and group > 1:
        token = tokens_rank * (moe_layers / p.pp) * h * abytes * 2 * passes * imbalance
        # experts have their own rank order (etp-ep-edp-pp): a group is consecutive ranks, so the
        # peers on the rank's node are reached over NVLink, the others over the network, at once
        on_node = min(group, per_node)
        nv, net = a2a_copies(hf, group, on_node, getattr(eff, "node_dispatch", False))
        a2a = token * max(nv / _link(device, True, eff), net / _link(device, False, eff))
    if p.tp > 1:
        other += tokens_rank * (layers / p.pp) * 4 * h * abytes * (p.tp - 1) * passes / _link(device, True, eff)
    if p.cp > 1:  # ring attention: each rank's key/value chunk visits the cp - 1 others, per layer and pass
        ring = tokens_rank * (layers / p.pp) * _kv_elements(hf) * abytes * (p.cp - 1) * passes
        other += ring / _link(device, p.tp * p.cp <= per_node, eff)
    if p.pp > 1:  # each micro-batch's activations (forward) and their gradients (backward) cross
        # every virtual stage boundary: a rank sends vpp times per direction, not once
        sp = p.sequence_parallel if p.sequence_parallel is not None else p.tp > 1
        sent = tokens_rank * p.tp / (p.tp if sp else 1) * h * abytes * 2 * p.vpp
        other += sent / _link(device, world // p.pp < per_node, eff)
    return a2a, other


def update_time(
    cfg,
    hf: dict,
    device: Device,
    train_mem,
    mean_response: float,
    eff,
    devices_per_node: int,
    micro_batches: int,
) -> tuple[float, float, float]:
    """(update seconds, its model FLOPs, its GEMM seconds alone) of the actor."""
    hf = _as_dict(hf)
    a, p = cfg.actor, cfg.actor.parallel
    world = cfg.cluster.num_actor_ranks
    per_node = devices_per_node or world
    rows = cfg.data.train_batch_size * cfg.rollout.n
    length = cfg.data.max_prompt_length + mean_response
    model_flops = 3 * _forward_flops(hf, rows, length) * a.ppo_epochs
    passes = (4 if getattr(a, "recompute", "none") == "full" else 3) * a.ppo_epochs
    compute = passes * forward_seconds(cfg, hf, device, rows, length, eff) / world
    dp = max(world // (p.tp * p.pp * p.cp), 1)
    tokens_rank = _tokens(cfg, mean_response) * a.ppo_epochs / (dp * p.cp * p.tp)
    from megarl.perf.memory import micro_batch_tokens

    scale, imbalance = compute_scale(cfg, hf, length, micro_batch_tokens(cfg) / p.cp, eff)
    busy = compute * scale
    t = busy * (1 + _bubble(p, micro_batches))
    a2a, other = comm_time(cfg, hf, device, tokens_rank, per_node, eff, imbalance)
    t += exposed(a2a, busy, getattr(eff, "a2a_overlap", 0.0)) + other
    steps = max(1, rows // a.ppo_mini_batch_size) * a.ppo_epochs
    if dp > 1:  # gradient reduce-scatter + parameter all-gather per optimizer step
        dp_s = (train_mem.grads + train_mem.params) * (dp - 1) / dp / _link(device, world <= per_node, eff)
        t += steps * exposed(dp_s, busy / steps, getattr(eff, "dp_overlap", 0.0))
    t += optimizer_time(cfg, hf, device, train_mem, eff, steps)
    off = a.offload
    moved = (
        (train_mem.params if off.params else 0)
        + (train_mem.grads if off.grads else 0)
        + (train_mem.optimizer if off.optimizer else 0)
    )
    t += 2 * moved / (device.pcie_bw * eff.link)
    stage_layers = hf["num_hidden_layers"] / p.pp
    t += micro_batches * steps * 2 * stage_layers * eff.layer_pass_s + steps * eff.optimizer_step_s + eff.phase_s
    return t, model_flops, compute


def log_prob_time(cfg, hf: dict, device: Device, mean_response: float, eff, micro_batches: int) -> float:
    """Forward passes over every row (old log-probs, + reference, + critic values), each at the
    slowest stage's pace with its bubble."""
    hf = _as_dict(hf)
    p = cfg.actor.parallel
    rows = cfg.data.train_batch_size * cfg.rollout.n
    length = cfg.data.max_prompt_length + mean_response
    passes = 1 + bool(cfg.ref.enabled) + bool(cfg.critic.enabled)
    world = cfg.cluster.num_actor_ranks
    from megarl.perf.memory import micro_batch_tokens

    scale, _ = compute_scale(cfg, hf, length, micro_batch_tokens(cfg) / p.cp, eff)
    t = forward_seconds(cfg, hf, device, rows, length, eff) / world * scale * (1 + _bubble(p, micro_batches))
    return passes * (t + micro_batches * hf["num_hidden_layers"] / p.pp * eff.layer_pass_s + eff.phase_s)
