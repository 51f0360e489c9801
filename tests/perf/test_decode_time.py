"""The decode side of the time model (megarl/perf/steptime.py generation_time): the batch a paged KV
cache lets run, and the per-kernel roofline of a decode step."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, *overrides: str):
    from megarl.config.loader import load_config
    from megarl.config.validate import validate

    cfg = validate(load_config(str(ROOT / "configs" / f"{name}.yaml"), list(overrides)))
    return cfg, json.loads((ROOT / cfg.model.path / "config.json").read_text())


def test_the_running_batch_follows_the_mean_length_a_paged_cache_holds_not_the_cap():
    """A cache with room for every sequence at the mean length (but not at the cap) runs them all at
    once: as fast as an unbounded cache. With room for half of them the batch halves (more steps,
    each lighter): the time moves."""
    from megarl.perf.hardware import parse_devices
    from megarl.perf.memory import rollout_memory
    from megarl.perf.steptime import GPU_EFFICIENCY, generation_time

    _, device = parse_devices("8xH100")
    cfg, hf = _load("qwen3-30b-a3b")
    mem = rollout_memory(cfg, hf, device)
    rows = cfg.data.train_batch_size * cfg.rollout.n
    concurrent = min(cfg.rollout.max_batch_size, -(-rows // cfg.rollout.num_servers))
    mean = cfg.rollout.max_new_tokens / 4
    at_mean = int(concurrent * (cfg.data.max_prompt_length + mean))
    assert at_mean < mem.kv_needed  # the cap would not fit

    def gen(capacity: int) -> float:
        return generation_time(cfg, hf, device, replace(mem, kv_capacity=capacity), mean, GPU_EFFICIENCY)

    assert gen(at_mean) == pytest.approx(gen(10**12), rel=1e-12)
    assert abs(gen(at_mean // 2) / gen(at_mean) - 1) > 1e-3


def test_a_decode_step_is_the_sum_of_its_kernels_each_bound_by_bytes_or_flops():
    """Two sequences an engine on H100 (every kernel memory-bound): a step reads the engine's weights
    (the routed experts its tokens pick) and their caches once. On H20 (296 TF FP8, 148 TF bf16 against
    4 TB/s) a large batch makes the dense GEMMs compute-bound while the experts and attention stay
    bound by their bytes: the step is longer than the larger of all bytes and all FLOPs."""
    from megarl.perf.flops import count_params, layer_params
    from megarl.perf.hardware import parse_devices
    from megarl.perf.memory import rollout_memory
    from megarl.perf.steptime import GPU_EFFICIENCY, generation_time

    cfg, hf = _load("qwen3-30b-a3b", "data.train_batch_size=2", "rollout.n=8", "actor.ppo_mini_batch_size=16")
    _, h100 = parse_devices("8xH100")
    mem = rollout_memory(cfg, hf, h100)
    eff = replace(GPU_EFFICIENCY, step_overhead_s=0.0, collective_s=0.0, link=1e9, prefill=1e9, phase_s=0.0)
    mean = 64.0
    t = generation_time(cfg, hf, h100, mem, mean, eff)
    steps, running = cfg.rollout.max_new_tokens, 2  # two sequences an engine: the cap's steps
    c, layers = count_params(hf), [layer_params(hf, i) for i in range(hf["num_hidden_layers"])]
    routed = sum(lp.experts * lp.expert for lp in layers) / c.total
    k, experts = hf["num_experts_per_tok"], hf["num_experts"]
    weights = mem.weights * cfg.rollout.tp * (1 - routed * (1 - k / experts) ** running)
    ctx = cfg.data.max_prompt_length + mean / 2
    kv = running * ctx * mem.kv_per_token * cfg.rollout.tp
    bw = cfg.rollout.tp * h100.hbm_bw * eff.decode_bw
    comm = (
        2
        * hf["num_hidden_layers"]
        * running
        * hf["hidden_size"]
        * 2
        * 2
        * (cfg.rollout.tp - 1)
        / cfg.rollout.tp
        / (h100.nvlink_bw * eff.link)
    )
    assert t == pytest.approx(steps * ((weights + kv) / bw + comm), rel=1e-3)

    big, hf = _load("qwen3-30b-a3b", "rollout.max_batch_size=512", "data.train_batch_size=256")
    _, h20 = parse_devices("8xH20")
    mem = replace(rollout_memory(big, hf, h20), kv_capacity=10**12)
    seqs = -(-big.data.train_batch_size * big.rollout.n // big.rollout.num_servers)
    running, resp = min(512, seqs), 4096.0
    steps = max(big.rollout.max_new_tokens, seqs * resp / running + big.rollout.max_new_tokens - resp)
    summed = generation_time(big, hf, h20, mem, resp, eff)
    bytes_only = generation_time(big, hf, h20, mem, resp, replace(eff, decode_compute=1e9))
    # the dense GEMMs alone turn compute-bound: the step grows by their FLOP time over their byte time
    routed_active = sum(k * lp.expert for lp in layers if lp.experts)
    dense_flops = running * 2 * (c.matmul_active - routed_active)
    dense_bytes = mem.weights * big.rollout.tp * (1 - routed)
    rate, bw = big.rollout.tp * 148e12 * eff.decode_compute, big.rollout.tp * h20.hbm_bw * eff.decode_bw
    assert dense_flops / rate > dense_bytes / bw
    assert summed - bytes_only == pytest.approx(steps * (dense_flops / rate - dense_bytes / bw), rel=1e-6)
