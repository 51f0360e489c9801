"""The update's time terms (megarl/perf/update_time.py), each against a hand computation from the
layout: the host optimizer, the busiest expert rank, communication hidden under compute, the
slowest pipeline stage and the stage-to-stage traffic that interleaving multiplies."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, *overrides: str):
    from megarl.config.loader import load_config
    from megarl.config.validate import validate

    cfg = validate(load_config(str(ROOT / "configs" / f"{name}.yaml"), list(overrides)))
    hf = json.loads((ROOT / cfg.model.path / "config.json").read_text())
    return cfg, hf


def _update(cfg, hf, eff, device="16xH100", m=4):
    from megarl.perf.hardware import parse_devices
    from megarl.perf.memory import train_memory
    from megarl.perf.update_time import update_time

    _, dev = parse_devices(device)
    return update_time(cfg, hf, dev, train_memory(cfg, hf, dev), 4096, eff, 8, m)[0]


def test_host_optimizer_pays_pcie_both_ways_and_host_adam_for_its_fraction():
    """CPU Adam (actor.offload.host_optimizer = 1): the rank's optimizer shard leaves the device's
    Adam step and costs fp32 gradients down + bf16 parameters up over PCIe and the host's Adam."""
    from megarl.perf.hardware import parse_devices
    from megarl.perf.memory import stage_params
    from megarl.perf.steptime import GPU_EFFICIENCY as eff

    cfg, hf = _load("qwen3-30b-a3b")
    # the colocation offload of the optimizer state moves less of it once the host holds its
    # share (a term of its own): kept out of this difference
    cfg.actor.offload.optimizer = False
    host = copy.deepcopy(cfg)
    host.actor.offload.host_optimizer = 1.0  # set as the published-run harness does
    _, dev = parse_devices("16xH100")
    p = cfg.actor.parallel
    st = stage_params(hf, p)[0]
    shard = st.dense / (16 // (p.tp * p.pp)) + st.expert / (16 // (p.ep * p.etp * p.pp))
    steps = cfg.data.train_batch_size * cfg.rollout.n // cfg.actor.ppo_mini_batch_size
    on_host = shard * (6 / (dev.pcie_bw * eff.link) + 1 / eff.host_adam_params_s)
    off_device = shard * 12 * 2 / dev.hbm_bw
    assert _update(host, hf, eff) - _update(cfg, hf, eff) == pytest.approx(steps * (on_host - off_device), rel=1e-6)
    half = copy.deepcopy(host)
    half.actor.offload.host_optimizer = 0.5
    assert _update(half, hf, eff) - _update(cfg, hf, eff) == pytest.approx(steps * (on_host - off_device) / 2, rel=1e-6)


def test_busiest_expert_rank_follows_the_routing_statistics():
    from megarl.perf.update_time import moe_imbalance

    _, hf = _load("qwen3-30b-a3b")  # 128 experts, top-8
    assert moe_imbalance(hf, 16384, 8, 0.0) == 1.0  # forced balance
    assert moe_imbalance(hf, 16384, 1, 0.7) == 1.0  # one expert rank holds every expert
    expected = 1 + math.sqrt(1 / (16384 * 8) + 0.7**2 * 8 / 128) * math.sqrt(2 * math.log(8))
    assert moe_imbalance(hf, 16384, 8, 0.7) == pytest.approx(expected, rel=1e-12)
    assert moe_imbalance(hf, 16384, 32, 0.7) > moe_imbalance(hf, 16384, 8, 0.7)  # fewer experts a rank
    dense = {**hf, "model_type": "qwen3", "num_experts": 0}
    assert moe_imbalance(dense, 16384, 8, 0.7) == 1.0


def test_real_routing_slows_the_update_forced_balance_does_not():
    from megarl.perf.steptime import GPU_EFFICIENCY

    cfg, hf = _load("qwen3-30b-a3b")
    balanced = _update(cfg, hf, replace(GPU_EFFICIENCY, routing_cv=0.0))
    assert _update(cfg, hf, replace(GPU_EFFICIENCY, routing_cv=0.5)) > balanced * 1.05


def test_overlapped_traffic_is_charged_only_beyond_the_compute():
    from megarl.perf.update_time import exposed

    assert exposed(3.0, 10.0, 0.0) == 3.0
    assert exposed(3.0, 10.0, 1.0) == 0.0
    assert exposed(3.0, 1.0, 1.0) == pytest.approx(2.0)  # longer than the compute it hides under
    assert exposed(4.0, 10.0, 0.5) == pytest.approx(2.0)


def test_data_parallel_overlap_hides_the_gradient_traffic():
    """dp = 8 on 16 H100 over two nodes: overlapping the whole reduce-scatter / all-gather under
    the backward removes exactly that traffic (the compute is far longer)."""
    from megarl.perf.hardware import parse_devices
    from megarl.perf.memory import train_memory
    from megarl.perf.steptime import GPU_EFFICIENCY

    cfg, hf = _load("qwen3-30b-a3b")
    _, dev = parse_devices("16xH100")
    mem = train_memory(cfg, hf, dev)
    dp = 16 // cfg.actor.parallel.tp
    steps = cfg.data.train_batch_size * cfg.rollout.n // cfg.actor.ppo_mini_batch_size
    traffic = steps * (mem.grads + mem.params) * (dp - 1) / dp / (dev.net_bw * GPU_EFFICIENCY.link)
    none = _update(cfg, hf, replace(GPU_EFFICIENCY, dp_overlap=0.0))
    full = _update(cfg, hf, replace(GPU_EFFICIENCY, dp_overlap=1.0))
    assert none - full == pytest.approx(traffic, rel=1e-6)


def test_the_slowest_stage_sets_the_pace_output_layer_included():
    """DeepSeek-V3 at pp 16: the shipped split (3 dense layers first, 2 MoE layers next to the
    129k-vocabulary output layer last) against 4 MoE layers beside the output layer."""
    from megarl.config.schema import ParallelConfig
    from megarl.perf.update_time import _layer_flops_per_token, stage_imbalance

    _, hf = _load("deepseek-v3-671b")
    length = 2048.0
    per = [_layer_flops_per_token(hf, i, length) for i in range(61)]
    head = 2 * hf["vocab_size"] * hf["hidden_size"]
    shipped = ParallelConfig(pp=16, first_stage_layers=3, last_stage_layers=2)
    stages = [sum(per[:3])] + [sum(per[3 + 4 * s : 7 + 4 * s]) for s in range(14)] + [sum(per[59:]) + head]
    assert stage_imbalance(shipped, hf, length) == pytest.approx(16 * max(stages) / sum(stages), rel=1e-12)
    heavy_last = ParallelConfig(pp=16, first_stage_layers=1, last_stage_layers=4)  # 1 + 14 x 4 + 4
    assert stage_imbalance(ParallelConfig(pp=1), hf, length) == 1.0
    assert 1.0 < stage_imbalance(shipped, hf, length) < stage_imbalance(heavy_last, hf, length)


def test_bubble_is_interleaved_1f1b():
    from megarl.config.schema import ParallelConfig
    from megarl.perf.update_time import _bubble

    assert _bubble(ParallelConfig(pp=8, vpp=1), 32) == pytest.approx(7 / 32)
    assert _bubble(ParallelConfig(pp=8, vpp=4), 32) == pytest.approx(7 / 128)


def test_interleaving_multiplies_the_stage_to_stage_traffic():
    """Each micro-batch crosses every virtual stage boundary: with vpp chunks a rank sends its
    activations (and receives their gradients) vpp times, not once."""
    from megarl.perf.hardware import parse_devices
    from megarl.perf.steptime import GPU_EFFICIENCY as eff
    from megarl.perf.update_time import comm_time

    cfg, hf = _load("qwen3-30b-a3b", "actor.parallel.pp=4", "actor.parallel.ep=4", "actor.parallel.tp=1")
    _, dev = parse_devices("16xH100")
    tokens = 1e6
    one = comm_time(cfg, hf, dev, tokens, 8, eff, 1.0)[1]
    cfg.actor.parallel.vpp = 3
    three = comm_time(cfg, hf, dev, tokens, 8, eff, 1.0)[1]
    per_send = tokens * hf["hidden_size"] * 2 * 2 / (dev.nvlink_bw * eff.link)  # bf16, both directions
    assert one == pytest.approx(per_send, rel=1e-9)  # 16 / 4 = 4 ranks a stage: neighbours share a node
    assert three - one == pytest.approx(2 * per_send, rel=1e-9)


def test_fp8_runs_price_their_linear_gemms_at_the_fp8_peak():
    """A published FP8 run (eff.fp8_gemms) has its linear layers' FLOPs at the device's FP8 dense
    peak times gemm_fp8 and attention's core at the bf16 rate; the planner's own efficiency never
    sets it (megarl trains in bf16)."""
    from megarl.perf.flops import attention_flops_per_pair, count_params
    from megarl.perf.hardware import parse_devices
    from megarl.perf.steptime import GPU_EFFICIENCY
    from megarl.perf.update_time import forward_seconds

    assert {d: parse_devices(f"1x{d}")[1].peak_flops("fp8") for d in ("H100", "H20", "B200", "B300")} == {
        "H100": 1979e12,  # datasheet dense figures (megarl/perf/peak.py states the sources)
        "H20": 296e12,
        "B200": 4500e12,
        "B300": 4500e12,  # HGX B300: B200's FP8 and BF16; it gains dense FP4, memory and network
    }
    b200, b300 = parse_devices("1xB200")[1], parse_devices("1xB300")[1]
    assert (b300.net_bw, b300.memory > b200.memory) == (2 * b200.net_bw, True)  # 800 Gb/s NICs, 288 GB
    cfg, hf = _load("qwen3-30b-a3b")
    _, dev = parse_devices("16xH100")
    rows, length = 64, 4096.0
    linear = rows * 2 * count_params(hf).matmul_active * length
    attention = rows * attention_flops_per_pair(hf) * length * (length + 1) / 2
    # elementwise work, counted by hand for Qwen3-30B-A3B (48 MoE layers, h 2048, k 8, expert ffn
    # 768): norms and residuals 10h, per routed copy activation 3 x 768 + permute 2h + combine h,
    # the combine's write h; bf16, at 0.8 of the 3.35 TB/s
    per_layer = 10 * 2048 + 8 * (3 * 768 + 3 * 2048) + 2048
    streamed = rows * length * 48 * per_layer * 2 / (3.35e12 * 0.8)
    eff = replace(GPU_EFFICIENCY, gemm=0.5, gemm_fp8=0.3)
    want = (linear + attention) / (989.5e12 * 0.5) + streamed
    assert forward_seconds(cfg, hf, dev, rows, length, eff) == pytest.approx(want, rel=1e-9)
    assert 0.15 < streamed / want < 0.25  # a small hidden size: a fifth of the forward is not GEMMs
    fp8 = replace(eff, fp8_gemms=True)
    want = linear / (1979e12 * 0.3) + attention / (989.5e12 * 0.5) + streamed
    assert forward_seconds(cfg, hf, dev, rows, length, fp8) == pytest.approx(want, rel=1e-12)
    assert GPU_EFFICIENCY.fp8_gemms is False


def _sampled_remote_nodes(hf: dict, group: int, on_node: int, samples: int = 20000) -> float:
    """Independent reference: route `samples` tokens at random (topk_group of n_group groups, then k
    distinct experts among theirs) from a random node; count the other nodes they reach."""
    import random

    rng = random.Random(0)
    experts, k = hf["n_routed_experts"] if "n_routed_experts" in hf else hf["num_experts"], hf["num_experts_per_tok"]
    n_group, topk_group = hf.get("n_group") or 1, hf.get("topk_group") or 1
    per_group, nodes = experts // n_group, group // on_node
    total = 0
    for _ in range(samples):
        groups = rng.sample(range(n_group), topk_group)
        pool = [g * per_group + i for g in groups for i in range(per_group)]
        hit = {e * nodes // experts for e in rng.sample(pool, k)}
        total += len(hit - {rng.randrange(nodes)})
    return total / samples


def test_node_level_dispatch_crosses_the_network_once_per_remote_node_a_token_reaches():
    """DeepSeek-V3 (n_group 8, topk_group 4, k 8): with node-level dispatch a token crosses the
    network once per other node its k experts sit on, which group-limited routing keeps down; per
    routed copy (Megatron's alltoall dispatcher) it sends k copies whatever the routing. The
    expected node count is checked against a sampled routing (20,000 tokens, within 0.03)."""
    from megarl.perf.update_time import a2a_copies, remote_nodes

    _, hf = _load("deepseek-v3-671b")
    assert (hf["n_group"], hf["topk_group"], hf["num_experts_per_tok"]) == (8, 4, 8)
    ungrouped = {k: v for k, v in hf.items() if k not in ("n_group", "topk_group")}
    for h in (hf, ungrouped):
        for group in (16, 32, 64, 128):
            assert remote_nodes(h, group, 8) == pytest.approx(_sampled_remote_nodes(h, group, 8), abs=0.03)
    # 64 expert ranks over 8 nodes, a routing group each: 4 of 8 chosen, so a node is hit at most
    # half the time (less: a chosen group can still get none of the 8 experts)
    assert 0.4 * 7 < remote_nodes(hf, 64, 8) < 0.5 * 7
    assert remote_nodes(hf, 64, 8) < remote_nodes(ungrouped, 64, 8) < 7
    assert remote_nodes(hf, 8, 8) == 0
    assert a2a_copies(hf, 64, 8, True) == pytest.approx((8 * 7 / 8, remote_nodes(hf, 64, 8)))
    assert a2a_copies(hf, 64, 8, False) == pytest.approx((8 * 7 / 64, 8 * 56 / 64))
    assert a2a_copies(hf, 8, 8, True) == a2a_copies(hf, 8, 8, False)  # inside a node: nothing to save


def test_node_dispatch_halves_deepseeks_network_bound_all_to_all():
    """End to end through comm_time: DeepSeek-V3 with its experts over 8 nodes (ep 64) is network
    bound; node-level dispatch sends a copy per remote node reached (under 3.5 of the 7 remote copies'
    worth: the routing groups sit on 4 of the 8 nodes)."""
    from megarl.perf.hardware import parse_devices
    from megarl.perf.steptime import GPU_EFFICIENCY
    from megarl.perf.update_time import comm_time, remote_nodes

    cfg, hf = _load("deepseek-v3-671b")
    cfg.actor.parallel.tp, cfg.actor.parallel.cp, cfg.actor.parallel.pp = 1, 1, 1
    cfg.actor.parallel.ep, cfg.actor.parallel.etp = 64, 1
    _, dev = parse_devices("64xH100")
    per_copy, _ = comm_time(cfg, hf, dev, 4096.0, 8, GPU_EFFICIENCY, 1.0)
    node, _ = comm_time(cfg, hf, dev, 4096.0, 8, replace(GPU_EFFICIENCY, node_dispatch=True), 1.0)
    assert node / per_copy == pytest.approx(remote_nodes(hf, 64, 8) / (8 * 56 / 64)) and node / per_copy < 0.5
