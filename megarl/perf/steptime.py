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
- update: megarl/perf/update_time.py (GEMMs at the slowest pipeline stage and the busiest expert
  rank, the bubble, all-to-all, tensor / context / pipeline traffic, data-parallel traffic less
  what overlaps, the optimizer step on the device or the host, offload over PCIe).
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
from megarl.perf.update_time import (  # noqa: F401  (re-exported: the planner's time model in one place)
    _bubble,
    _dtype,
    _forward_flops,
    _kv_elements,
    _moe_layers,
    _tokens,
    log_prob_time,
    update_time,
)


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
    # fraction of the data-parallel gradient reduce-scatter / parameter all-gather that runs under
    # backward / forward when the engine overlaps them (Megatron's overlap_grad_reduce /
    # overlap_param_gather); megarl's engine does not, so the planner's own runs use 0
    dp_overlap: float = 0.0
    a2a_overlap: float = 0.0  # the same for the expert all-to-all (1F1B / delayed-wgrad overlap)
    # coefficient of variation of the expert loads a balanced router leaves (update_time.moe_imbalance);
    # 0: forced balance
    routing_cv: float = 0.0
    # CPU Adam (actor.offload.host_optimizer): parameters a second per device, its share of the host
    # (a 2-socket node streams ~200 GB/s; Adam touches ~24-32 bytes a parameter; 8 devices a node)
    host_adam_params_s: float = 1.0e9
    # FP8 GEMMs (the linear layers; attention's core stays bf16): fraction of the device's FP8 dense
    # peak. A constant of its own, not `gemm`: an FP8 GEMM also quantizes its inputs and applies
    # per-block scales, work a bf16 GEMM does not do, so the share of its (doubled) peak it reaches
    # is a different number. Read only when fp8_gemms is set
    gemm_fp8: float = 0.35
    # a published run's GEMMs ran in FP8 (benchmarks/_published.py sets it from the run's precision).
    # megarl trains in bf16: no config sets this, the planner's own plans never do
    fp8_gemms: bool = False
    # the expert dispatch sends a token once per destination node and fans it out over NVLink
    # there (DeepEP-style), instead of once per routed copy (Megatron's alltoall dispatcher, megarl's
    # actor.moe.dispatcher): update_time.network_copies
    node_dispatch: bool = False


# fitted 2026-12-05 on the fit half of benchmarks/published_runs.yaml (benchmarks/_calibration.py:
# least squares on log(predicted / measured), multi-start coordinate descent; `bench_plan.py
# --calibration --fit` reruns it), with every run's weight sync priced as its source moved the
# weights (per transport), the host optimizer, FP8 GEMMs at the FP8 peak, node-level expert
# dispatch, elementwise traffic, a paged KV cache and a per-kernel decode roofline; the rest are
# stated. dp_overlap: the fit put the overlapping frameworks' hidden share of data-parallel traffic
# at 0, which is also megarl's own (its engine does not overlap). gemm_fp8 moves only the FP8 runs
# (three in the fit half). decode_bw is low and routing_cv at its bound: the fit leans on them for
# time the model does not explain (RESULTS.md, "Planner calibration")
GPU_EFFICIENCY = Efficiency(
    gemm=0.5916,
    gemm_fp8=0.2228,
    prefill=0.4086,
    decode_bw=0.2806,
    link=0.5348,
    step_overhead_s=0.01016,
    tensor_s=0.6043e-3,
    dp_overlap=0.0,
    routing_cv=1.0,
)
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


def generation_time(cfg, hf: dict, device: Device, rollout_mem, mean_response: float, eff: Efficiency) -> float:
    hf = _as_dict(hf)
    r = cfg.rollout
    rows = cfg.data.train_batch_size * r.n
    seqs = math.ceil(rows / r.num_servers)
    prompt = cfg.data.max_prompt_length
    # the KV cache is paged: a sequence holds its own tokens, not the cap's, so the batch the cache
    # lets run follows the mean length (the memory check keeps the cap: rollout_memory)
    concurrent = min(r.max_batch_size, seqs)
    held = min(1.0, rollout_mem.kv_capacity / max(concurrent * (prompt + mean_response), 1))
    running = max(1, int(concurrent * held))
    ctx = prompt + mean_response / 2  # mean context over a response's decode steps
    c = count_params(hf)
    pair = attention_flops_per_pair(hf)
    peak = device.peak_flops("bf16" if device.name != "CPU" else "fp32") * r.tp
    prefill = (2 * c.matmul_active * prompt + pair * prompt * (prompt + 1) / 2) * seqs / (peak * eff.prefill)
    moe_layers, experts, k = _moe_layers(hf)
    weights = rollout_mem.weights * r.tp  # the engine's weights, all its devices
    routed_share = routed_active = 0.0
    if moe_layers:
        per_layer = [layer_params(hf, i) for i in range(hf["num_hidden_layers"])]
        routed_share = sum(lp.experts * lp.expert for lp in per_layer) / c.total
        routed_active = sum(k * lp.expert for lp in per_layer if lp.experts)
    # routed experts a step touches: each is hit with probability 1 - (1 - k/E)^B
    routed = weights * routed_share * (1 - (1 - k / experts) ** running) if moe_layers else 0.0
    dense = weights * (1 - routed_share)
    kv = running * ctx * rollout_mem.kv_per_token * (r.tp // r.dp)  # every attention rank reads its share
    # a roofline per kind of kernel, run one after another: the dense GEMMs (weights read once for
    # the batch), the routed experts' GEMMs (a few tokens each: bound by their weights), attention
    # over the cache (bound by the cache); each is as slow as the slower of its bytes and its FLOPs
    bw, rate = r.tp * device.hbm_bw * eff.decode_bw, peak * eff.decode_compute
    kernels = (
        max(dense / bw, running * 2 * (c.matmul_active - routed_active) / rate)
        + max(routed / bw, running * 2 * routed_active / rate)
        + max(kv / bw, running * pair * ctx / rate)
    )
    layers = hf["num_hidden_layers"]
    # two tensor-parallel all-reduces per layer: latency, and B hidden states each over the link
    link = (device.nvlink_bw if r.nnodes == 1 else device.net_bw) * eff.link
    # DP attention (rollout.dp > 1) skips attention's all-reduce, but the MLP and experts still span
    # the engine's tp ranks: a gather before them and a scatter after, each half an all-reduce's bytes
    reduce_bytes = running * hf["hidden_size"] * 2 * (2 if r.dp == 1 else 1) * (r.tp - 1) / r.tp
    comm = 2 * layers * (eff.collective_s * (1 if r.nnodes == 1 else 3) + reduce_bytes / link)
    t_step = kernels + eff.step_overhead_s + comm
    steps = max(r.max_new_tokens, seqs * mean_response / running + (r.max_new_tokens - mean_response))
    return prefill + steps * t_step + eff.phase_s


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
