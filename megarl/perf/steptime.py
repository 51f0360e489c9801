"""Step time of a run, predicted: generation, log-prob passes, update and weight sync.

Each phase is a roofline over the device's datasheet figures (megarl/perf/hardware.py) times a
stated efficiency, plus its communication and fixed costs:

- generation, per engine (the engines split the rows evenly): prefill of every prompt
  (compute-bound), then decode steps. A step of B running sequences costs the larger of its FLOPs
  and its bytes read (the weights it touches: dense weights always, routed experts as far as
  B * top_k tokens reach them; the KV cache of B sequences at their mean context) plus a per-step
  fixed cost and two tensor-parallel all-reduces per layer (latency + B hidden states over
  NVLink, or over the network when the engine spans nodes; with DP attention a gather and a
  scatter of the engine's B hidden states instead, as its MLP and experts still span tp). B is rollout.max_batch_size, or fewer
  when the KV cache cannot hold that many full-length sequences. With continuous batching the
  engine runs rows * mean / B steps, and the longest response adds its tail (max - mean) at the end.
- log-probs (old, ref, critic values): forward FLOPs of every row at prompt + mean response.
- update: 3x forward (4x with full recompute: the hardware does the extra forward, MFU does
  not count it), the pipeline bubble (pp - 1) / (vpp * micro-batches), MoE all-to-all (dispatch +
  combine per MoE layer over the expert group ep * etp, over NVLink when it fits a node, else the
  network),
  sequence-parallel gathers/scatters, context parallel's ring of key/value chunks, the data-parallel gradient reduce-scatter and parameter
  all-gather per optimizer step, and the offload traffic over PCIe.
- weight sync: the configured transport's prediction (megarl/perf/sync_model.py prices every
  transport by its links, gathers, engine load and per-tensor costs).

The efficiencies are the planner's one assumption; they are calibrated against published runs in
benchmarks/RESULTS.md ("Planner calibration"), where the prediction errors are reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.perf.flops import _as_dict, attention_flops_per_pair, count_params, layer_params
from megarl.perf.hardware import Device
from megarl.perf.sync_model import hf_tensor_count, sync_time  # noqa: F401  (steptime's names before sync_model)


@dataclass(frozen=True)
class Efficiency:
    gemm: float = 0.5  # training / log-prob GEMMs, fraction of peak (Megatron, bf16, h >= 2048)
    prefill: float = 0.5  # rollout prefill, fraction of peak
    decode_bw: float = 0.6  # decode: fraction of HBM bandwidth reached
    decode_compute: float = 0.3  # decode: fraction of peak when a step is compute-bound
    link: float = 0.7  # NVLink / network / PCIe: fraction of the datasheet bandwidth
    step_overhead_s: float = 0.010  # per decode step: scheduler, sampling, launches, stragglers
    collective_s: float = 10e-6  # latency of one tensor-parallel all-reduce inside a node
    layer_pass_s: float = 0.0  # fixed cost per layer and micro-batch forward (launches, Python);
    # backward as much again. A stage runs its own layers only
    optimizer_step_s: float = 0.0  # fixed cost per optimizer step (clip, step, gathers)
    phase_s: float = 0.0  # fixed cost per phase (RPCs to the ranks, gathers of results)
    tensor_s: float = 0.75e-3  # weight sync: per checkpoint tensor (gather, handle, engine load)


GPU_EFFICIENCY = Efficiency()
# CPU: the quickstart's tiny model is all fixed costs; these come from timing the quickstart's
# default layout on a 2-core host (benchmarks/bench_plan.py, RESULTS.md "Planner on CPU")
CPU_EFFICIENCY = Efficiency(
    gemm=0.5,
    prefill=0.3,
    decode_bw=0.5,
    decode_compute=0.3,
    link=0.5,
    step_overhead_s=0.02,
    collective_s=1e-4,
    layer_pass_s=0.017,
    optimizer_step_s=0.045,
    phase_s=0.03,
    tensor_s=3e-4,
)


@dataclass(frozen=True)
class StepTime:
    generation: float
    log_prob: float  # old log-probs (+ ref, + critic values)
    update: float  # actor (+ critic) update
    weight_sync: float
    train_flops: float  # model FLOPs of the actor update (MFU's numerator)
    update_compute: float  # the update's GEMM time alone (before bubble and communication)

    @property
    def total(self) -> float:
        return self.generation + self.log_prob + self.update + self.weight_sync

    @property
    def overlapped(self) -> float:
        """An asynchronous loop on pools of their own: each step takes the slower side, the engines
        generating or the trainer scoring, updating and syncing (its pause of generation is
        counted on the trainer's side only). A lower bound: contention and staleness ignored."""
        return max(self.generation, self.log_prob + self.update + self.weight_sync)


def _moe_layers(hf: dict) -> tuple[int, int, int]:
    """(MoE layers, experts, top-k)."""
    n, experts = 0, 0
    for i in range(hf["num_hidden_layers"]):
        lp = layer_params(hf, i)
        if lp.experts:
            n, experts = n + 1, lp.experts
    return n, experts, hf.get("num_experts_per_tok") or 0


def generation_time(cfg, hf: dict, device: Device, rollout_mem, mean_response: float, eff: Efficiency) -> float:
    hf = _as_dict(hf)
    r = cfg.rollout
    rows = cfg.data.train_batch_size * r.n
    seqs = math.ceil(rows / r.num_servers)
    running = max(1, int(min(r.max_batch_size, seqs) * rollout_mem.concurrency_fraction))
    prompt = cfg.data.max_prompt_length
    ctx = prompt + mean_response / 2  # mean context over a response's decode steps
    c = count_params(hf)
    pair = attention_flops_per_pair(hf)
    peak = device.peak_flops("bf16" if device.name != "CPU" else "fp32") * r.tp
    prefill = (2 * c.matmul_active * prompt + pair * prompt * (prompt + 1) / 2) * seqs / (peak * eff.prefill)
    moe_layers, experts, k = _moe_layers(hf)
    weights = rollout_mem.weights * r.tp  # the engine's weights, all its devices
    if moe_layers:  # routed experts a step touches: each is hit with probability 1 - (1 - k/E)^B
        expert_share = (
            sum(lp.experts * lp.expert for lp in map(lambda i: layer_params(hf, i), range(hf["num_hidden_layers"])))
            / c.total
        )
        weights *= 1 - expert_share * (1 - k / experts) ** running
    kv = running * ctx * rollout_mem.kv_per_token * (r.tp // r.dp)  # every attention rank reads its share
    step_bytes = weights + kv
    step_flops = running * (2 * c.matmul_active + pair * ctx)
    layers = hf["num_hidden_layers"]
    # two tensor-parallel all-reduces per layer: latency, and B hidden states each over the link
    link = (device.nvlink_bw if r.nnodes == 1 else device.net_bw) * eff.link
    # DP attention (rollout.dp > 1) skips attention's all-reduce, but the MLP and experts still span
    # the engine's tp ranks: a gather before them and a scatter after, each half an all-reduce's bytes
    reduce_bytes = running * hf["hidden_size"] * 2 * (2 if r.dp == 1 else 1) * (r.tp - 1) / r.tp
    comm = 2 * layers * (eff.collective_s * (1 if r.nnodes == 1 else 3) + reduce_bytes / link)
    t_step = (
        max(step_bytes / (r.tp * device.hbm_bw * eff.decode_bw), step_flops / (peak * eff.decode_compute))
        + eff.step_overhead_s
        + comm
    )
    steps = max(r.max_new_tokens, seqs * mean_response / running + (r.max_new_tokens - mean_response))
    return prefill + steps * t_step + eff.phase_s


def _tokens(cfg, mean_response: float) -> float:
    return cfg.data.train_batch_size * cfg.rollout.n * (cfg.data.max_prompt_length + mean_response)


def _forward_flops(hf: dict, rows: int, length: float) -> float:
    c = count_params(hf)
    return rows * (2 * c.matmul_active * length + attention_flops_per_pair(hf) * length * (length + 1) / 2)


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
    return (p.pp - 1) / (p.vpp * max(micro_batches, 1))


def update_time(
    cfg,
    hf: dict,
    device: Device,
    train_mem,
    mean_response: float,
    eff: Efficiency,
    devices_per_node: int,
    micro_batches: int,
) -> tuple[float, float, float]:
    """(update seconds, its model FLOPs, its GEMM seconds alone) of the actor."""
    hf = _as_dict(hf)
    a, p = cfg.actor, cfg.actor.parallel
    world = cfg.cluster.num_actor_ranks
    rows = cfg.data.train_batch_size * cfg.rollout.n
    length = cfg.data.max_prompt_length + mean_response
    fwd = _forward_flops(hf, rows, length)
    model_flops = 3 * fwd * a.ppo_epochs
    hw_flops = (4 if getattr(a, "recompute", "none") == "full" else 3) * fwd * a.ppo_epochs
    peak = device.peak_flops(_dtype(cfg, device))
    compute = hw_flops / (world * peak * eff.gemm)
    t = compute * (1 + _bubble(p, micro_batches))
    dp = max(world // (p.tp * p.pp * p.cp), 1)
    tokens_rank = _tokens(cfg, mean_response) * a.ppo_epochs / (dp * p.cp * p.tp)
    passes = 3 if getattr(a, "recompute", "none") == "full" else 2
    moe_layers, experts, k = _moe_layers(hf)
    h = hf["hidden_size"]
    abytes = 2 if a.precision == "bf16" else 4
    group = p.ep * p.etp  # routed tokens travel over the expert group: all-to-all over ep, gathers over etp
    if moe_layers and group > 1:
        per_node = devices_per_node or world
        bw = (device.nvlink_bw if group <= per_node else device.net_bw) * eff.link
        a2a = tokens_rank * (moe_layers / p.pp) * k * h * abytes * 2 * passes * (group - 1) / group
        t += a2a / bw
    if p.tp > 1:
        sp_bytes = tokens_rank * (hf["num_hidden_layers"] / p.pp) * 4 * h * abytes * (p.tp - 1) * passes
        t += sp_bytes / (device.nvlink_bw * eff.link)
    if p.cp > 1:  # ring attention: each rank's key/value chunk visits the cp - 1 others, per layer and pass
        per_node = devices_per_node or world
        bw = (device.nvlink_bw if p.tp * p.cp <= per_node else device.net_bw) * eff.link
        t += tokens_rank * (hf["num_hidden_layers"] / p.pp) * _kv_elements(hf) * abytes * (p.cp - 1) * passes / bw
    steps = max(1, rows // a.ppo_mini_batch_size) * a.ppo_epochs
    dp_bytes = 0.0
    if dp > 1:
        dp_bytes = (train_mem.grads + train_mem.params) * (dp - 1) / dp
        per_node = devices_per_node or world
        bw = device.nvlink_bw if world <= per_node else device.net_bw
        t += steps * dp_bytes / (bw * eff.link)
    t += steps * (train_mem.optimizer * 2 + train_mem.grads) / device.hbm_bw  # the optimizer step
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


def log_prob_time(cfg, hf: dict, device: Device, mean_response: float, eff: Efficiency, micro_batches: int) -> float:
    hf = _as_dict(hf)
    p = cfg.actor.parallel
    rows = cfg.data.train_batch_size * cfg.rollout.n
    fwd = _forward_flops(hf, rows, cfg.data.max_prompt_length + mean_response)
    passes = 1 + bool(cfg.ref.enabled) + bool(cfg.critic.enabled)
    world = cfg.cluster.num_actor_ranks
    t = fwd / (world * device.peak_flops(_dtype(cfg, device)) * eff.gemm) * (1 + _bubble(p, micro_batches))
    return passes * (t + micro_batches * hf["num_hidden_layers"] / p.pp * eff.layer_pass_s + eff.phase_s)


def trainer_time(
    cfg,
    hf: dict,
    device: Device,
    train_mem,
    mean_response: float,
    eff: Efficiency,
    devices_per_node: int | None = None,
) -> tuple[float, float, float, float]:
    """(log-prob seconds, update seconds, update model FLOPs, update GEMM seconds): the trainer's
    side of a step, which depends on the actor's layout only (the layout search reuses it)."""
    from megarl.perf.memory import micro_batches_per_rank

    m = micro_batches_per_rank(cfg)
    rows = cfg.data.train_batch_size * cfg.rollout.n
    m_all = max(1, m * rows // max(cfg.actor.ppo_mini_batch_size, 1))  # micro-batches of one pass, all rows
    lp = log_prob_time(cfg, hf, device, mean_response, eff, m_all)
    upd, flops, compute = update_time(
        cfg, hf, device, train_mem, mean_response, eff, devices_per_node or cfg.cluster.devices_per_node, m
    )
    if cfg.critic.enabled:
        upd *= 2
    return lp, upd, flops, compute


def efficiency_of(device: Device) -> Efficiency:
    return CPU_EFFICIENCY if device.name == "CPU" else GPU_EFFICIENCY


def step_time(
    cfg,
    hf: dict,
    device: Device,
    train_mem,
    rollout_mem,
    mean_response: float | None = None,
    eff: Efficiency | None = None,
    devices_per_node: int | None = None,
) -> StepTime:
    eff = eff or efficiency_of(device)
    mean = float(mean_response if mean_response is not None else cfg.rollout.max_new_tokens)
    gen = generation_time(cfg, hf, device, rollout_mem, mean, eff)
    lp, upd, flops, compute = trainer_time(cfg, hf, device, train_mem, mean, eff, devices_per_node)
    return StepTime(gen, lp, upd, sync_time(cfg, hf, device, rollout_mem, eff), flops, compute)
