"""FLOPs model and device peaks (megarl/perf): hand counts, transformers as the independent
reference for parameter counts, published model-card counts, and the CPU-peak cache."""

import json
from pathlib import Path

import pytest
import torch

from megarl.models.tiny import PRESETS
from megarl.perf import flops, peak
from megarl.perf.flops import count_params, forward_flops, generation_flops, param_counts, train_flops

ROOT = Path(__file__).resolve().parents[2]


def _hf_model(cfg: dict):
    """The transformers model of this config on the meta device (no memory, no init)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_utils import no_init_weights

    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"), no_init_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # no_init_weights also skips the tying that from_config would do
    return model


def _hf_counts(cfg: dict) -> tuple[int, int]:
    """(total, activated) from the transformers model: activated drops the experts a token skips."""
    model = _hf_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    skipped = 0
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            per_expert = sum(p.numel() for p in experts[0].parameters())
            skipped += (len(experts) - cfg["num_experts_per_tok"]) * per_expert
    return total, total - skipped


# Hand counts of the tiny presets (vocab 64, hidden 64, 4 heads, untied embeddings).
# Shared by all: embed 64*64 + lm_head 64*64 + final norm 64 = 8256.
_EMBED = 64 * 64 + 64 * 64 + 64
_GQA = 64 * 64 + 2 * (64 * 2 * 16) + 64 * 64  # q, k, v (2 kv heads of 16), o = 12288
_MLP = 3 * 64 * 128  # gate, up, down = 24576
_NORMS = 2 * 64  # input + post-attention RMSNorm
# DeepSeek-V3 tiny MLA: q_a 64*32, q_b 32*4*(16+8), kv_a 64*(16+8), kv_b 16*4*(16+12), o 4*12*64
_MLA = 64 * 32 + 32 * 4 * 24 + 64 * 24 + 16 * 4 * 28 + 4 * 12 * 64
_MLA_NORMS = 32 + 16  # q_a_layernorm, kv_a_layernorm
_DS_EXPERT = 3 * 64 * 32  # moe_intermediate 32; the shared expert is the same size (1 shared)
_DS_MOE_TOTAL = 8 * 64 + _DS_EXPERT + 8 * _DS_EXPERT  # router + shared + 8 routed
_DS_MOE_ACTIVE = 8 * 64 + _DS_EXPERT + 2 * _DS_EXPERT  # router + shared + top-2
_Q3_EXPERT = 3 * 64 * 64  # moe_intermediate 64

HAND = {
    "tiny-qwen2": (_EMBED + 2 * (_GQA + (64 + 2 * 32) + _MLP + _NORMS),) * 2,  # + q/k/v biases
    "tiny-qwen3": (_EMBED + 2 * (_GQA + 2 * 16 + _MLP + _NORMS),) * 2,  # + per-head q/k norms
    "tiny-llama": (_EMBED + 2 * (_GQA + _MLP + _NORMS),) * 2,
    "tiny-qwen3-moe": (
        _EMBED + 2 * (_GQA + 2 * 16 + _NORMS + 4 * 64 + 4 * _Q3_EXPERT),  # router + 4 experts
        _EMBED + 2 * (_GQA + 2 * 16 + _NORMS + 4 * 64 + 2 * _Q3_EXPERT),  # router + top-2
    ),
    # the agent preset: tiny-qwen3-moe with a 128-token vocabulary (input and output embeddings)
    "tiny-qwen3-moe-tools": (
        128 * 64 * 2 + 64 + 2 * (_GQA + 2 * 16 + _NORMS + 4 * 64 + 4 * _Q3_EXPERT),  # + final norm
        128 * 64 * 2 + 64 + 2 * (_GQA + 2 * 16 + _NORMS + 4 * 64 + 2 * _Q3_EXPERT),
    ),
    "tiny-deepseek-v3": (  # layer 0 dense (first_k_dense_replace=1), layers 1-2 MoE
        _EMBED + 3 * (_MLA + _MLA_NORMS + _NORMS) + _MLP + 2 * _DS_MOE_TOTAL,
        _EMBED + 3 * (_MLA + _MLA_NORMS + _NORMS) + _MLP + 2 * _DS_MOE_ACTIVE,
    ),
}


@pytest.mark.parametrize("preset", sorted(HAND))
def test_tiny_counts_by_hand_and_against_transformers(preset):
    cfg = PRESETS[preset]
    assert param_counts(cfg) == HAND[preset]
    assert param_counts(cfg) == _hf_counts(cfg)


def test_presets_all_covered():
    assert set(HAND) == set(PRESETS)


@pytest.mark.parametrize(
    "preset,overrides",
    [
        ("tiny-qwen3", {"tie_word_embeddings": True}),  # tied: counted once
        ("tiny-llama", {"attention_bias": True, "mlp_bias": True}),
        ("tiny-qwen3-moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [1]}),
        ("tiny-deepseek-v3", {"q_lora_rank": None, "attention_bias": True, "first_k_dense_replace": 2}),
        ("tiny-deepseek-v3", {"n_shared_experts": 2, "num_hidden_layers": 4}),
    ],
)
def test_config_variants_against_transformers(preset, overrides):
    cfg = {**PRESETS[preset], **overrides}
    assert param_counts(cfg) == _hf_counts(cfg)


def test_tied_embeddings_counted_once_but_lm_head_still_multiplies():
    untied, tied = PRESETS["tiny-qwen3"], {**PRESETS["tiny-qwen3"], "tie_word_embeddings": True}
    assert count_params(untied).total - count_params(tied).total == 64 * 64
    assert count_params(untied).matmul_active == count_params(tied).matmul_active


def _real(name):
    return json.loads((ROOT / "configs" / "models" / name / "config.json").read_text())


# Published (model card) totals and activated counts, in billions. The activated figures are
# given to two significant digits and truncated, not rounded (the exact counts, equal to
# transformers', are 37.55B and 3.353B): they are checked against that precision below.
# DeepSeek's README_WEIGHTS.md gives a finer 36.7B for the main model (incl. embedding and head);
# the exact count is 0.85B (2.3%) above it, which is 58 x 7168 x 2048, one expert matrix per MoE
# layer: a different convention there we cannot reconstruct, not a missing component here.
PUBLISHED = {
    "deepseek-v3": (671.0, 37.0, 1.0),  # (total, activated, unit of the activated figure)
    "qwen3-30b-a3b": (30.5, 3.3, 0.1),
    "qwen3-235b-a22b": (235.0, 22.0, 1.0),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_counts(name):
    cfg = _real(name)
    total, active = param_counts(cfg)
    pub_total, pub_active, unit = PUBLISHED[name]
    assert abs(total / 1e9 - pub_total) / pub_total < 0.01
    assert pub_active <= active / 1e9 < pub_active + unit
    assert abs(active / 1e9 - pub_active) / pub_active < 0.02
    assert total == sum(p.numel() for p in _hf_model(cfg).parameters())


def test_deepseek_v3_mtp_layer_not_counted():
    cfg = _real("deepseek-v3")
    assert cfg["num_nextn_predict_layers"] == 1
    assert param_counts(cfg) == param_counts({**cfg, "num_nextn_predict_layers": 0})
    assert param_counts(cfg)[0] < 672e9  # the 685B checkpoint includes the 14B MTP module


def test_unsupported_and_sliding_window_refused():
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        param_counts({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="use_sliding_window"):
        forward_flops({**PRESETS["tiny-qwen2"], "use_sliding_window": True}, [8])


def test_forward_flops_hand_count():
    cfg = PRESETS["tiny-llama"]
    L = 10
    matmul = 64 * 64 + 2 * (_GQA + _MLP)  # LM head + per-layer projections and MLP
    attention = 2 * (2 * 2 * 4 * 16 * L * (L + 1) // 2)  # 2 layers x (QK^T + AV) x causal pairs
    assert forward_flops(cfg, [L]) == 2 * matmul * L + attention == 1_584_640
    assert count_params(cfg).matmul_active == matmul


def test_forward_flops_is_matmul_plus_attention_and_mla_widths():
    cfg = PRESETS["tiny-deepseek-v3"]
    c = count_params(cfg)
    # MLA: 4 heads, qk width 16 + 8, v width 12, 3 layers
    per_pair = 3 * 2 * 4 * (24 + 12)
    assert forward_flops(cfg, [7, 5]) == 2 * c.matmul_active * 12 + per_pair * (28 + 15)
    # the router is in the matmul term: top-2 experts plus the 8-way router per MoE layer
    assert c.matmul_active == (64 * 64 + 3 * _MLA + _MLP + 2 * _DS_MOE_ACTIVE)


def test_train_flops_and_recompute():
    cfg = PRESETS["tiny-qwen3-moe"]
    fwd = forward_flops(cfg, [16, 9])
    assert train_flops(cfg, [16, 9]) == 3 * fwd
    assert train_flops(cfg, [16, 9], recompute=True) == 4 * fwd


def test_attention_term_grows_quadratically_and_packing_has_no_padding_cost():
    cfg = _real("qwen3-30b-a3b")
    linear = 2 * count_params(cfg).matmul_active

    def attention(L):
        return forward_flops(cfg, [L]) - linear * L

    assert attention(8192) > 2 * attention(4096) > 0
    assert attention(8192) / attention(4096) == pytest.approx(4, rel=1e-3)
    # two packed sequences cost their own attention, not that of one 2L sequence
    assert forward_flops(cfg, [4096, 4096]) == 2 * forward_flops(cfg, [4096]) < forward_flops(cfg, [8192])


def test_generation_flops_prefill_plus_decode():
    cfg = PRESETS["tiny-qwen3"]
    c = count_params(cfg)
    per_pair = flops.attention_flops_per_pair(cfg)
    P, R = 12, 5
    # prefill yields the first response token; R - 1 tokens are fed back, each attending its prefix
    assert generation_flops(cfg, [P], [R]) == forward_flops(cfg, [P + R - 1])
    step = generation_flops(cfg, [P], [R + 1]) - generation_flops(cfg, [P], [R])
    assert step == 2 * c.matmul_active + per_pair * (P + R)  # one decode at position P+R
    assert generation_flops(cfg, [P, 3], [R, 1]) == generation_flops(cfg, [P], [R]) + forward_flops(cfg, [3])
    with pytest.raises(ValueError, match="differ in length"):
        generation_flops(cfg, [1, 2], [3])


def test_cpu_peak_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path))
    threads = torch.get_num_threads()
    first = peak.device_peak_flops("cpu", "fp32")
    assert first > 1e8  # any machine that runs this does > 0.1 GFLOP/s of fp32 GEMM
    assert torch.get_num_threads() == threads  # the single-threaded half restored the count
    entry = json.loads((tmp_path / "cpu_peak.json").read_text())[peak.cpu_cache_key("fp32")]
    assert entry["flops"] == first == max(entry["threaded_flops"], threads * entry["single_thread_flops"])
    assert entry["threads"] == threads

    def no_measure(*_):
        raise AssertionError("re-measured although the cache holds this host's peak")

    monkeypatch.setattr(peak, "measure_cpu_gemm_flops", no_measure)
    assert peak.device_peak_flops("cpu", "float32") == first
    assert peak._cache_path(None) == tmp_path / "cpu_peak.json"  # never the real home cache


def test_cpu_peak_keyed_by_thread_count(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(peak, "measure_cpu_gemm_flops", lambda dt: {"flops": calls.append(dt) or 5e10})
    monkeypatch.setattr(peak, "cpu_cache_key", lambda dt: f"cpu|threads={len(calls)}|{dt}")
    assert peak.cpu_peak_flops("fp32", cache_dir=tmp_path) == 5e10
    assert peak.cpu_peak_flops("fp32", cache_dir=tmp_path) == 5e10  # key changed: measured again
    assert len(calls) == 2 and len(json.loads((tmp_path / "cpu_peak.json").read_text())) == 2


def test_gpu_peaks_from_the_table(monkeypatch):
    names = {
        0: "NVIDIA H100 80GB HBM3",
        1: "NVIDIA A100-SXM4-80GB",
        2: "NVIDIA H100 PCIe",
        3: "NVIDIA GeForce RTX 4090",
    }
    monkeypatch.setattr(peak, "_gpu_name", lambda i: names[i])
    assert peak.device_peak_flops("cuda:0", "bf16") == 989.5e12
    assert peak.device_peak_flops("cuda:0", torch.bfloat16) == 989.5e12
    assert peak.device_peak_flops("cuda:2", "fp8") == 1513e12
    assert peak.device_peak_flops("cuda:1", "bf16") == 312e12
    with pytest.raises(ValueError, match="no fp8"):
        peak.device_peak_flops("cuda:1", "fp8")
    with pytest.raises(ValueError, match="NVIDIA GeForce RTX 4090"):
        peak.device_peak_flops("cuda:3", "bf16")
    assert peak.gpu_table_entry("NVIDIA H200") == "H200" and peak.gpu_table_entry("NVIDIA B200") == "B200"
    assert peak.gpu_table_entry("NVIDIA B300 SXM6 AC") == "B300"


def test_mfu():
    assert peak.mfu(4e15, 2.0, 4, 1e15) == 0.5
    with pytest.raises(ValueError):
        peak.mfu(1.0, 0.0, 1, 1.0)


def test_step_mfu_divides_model_flops_by_time_devices_and_peak():
    from megarl.models.tiny import PRESETS
    from megarl.perf.flops import forward_flops, train_flops
    from megarl.trainer.mfu import StepMfu

    cfg, lengths = dict(PRESETS["tiny-qwen3-moe"]), [7, 9, 12]
    step = StepMfu(cfg, devices=2, peak_flops=1e9, ppo_epochs=2)
    got = step.metrics(lengths, {"perf/update_s": 0.5, "perf/old_log_prob_s": 0.25})
    assert got["perf/mfu/update"] == pytest.approx(2 * train_flops(cfg, lengths) / (0.5 * 2 * 1e9))
    assert got["perf/mfu/log_prob"] == pytest.approx(forward_flops(cfg, lengths) / (0.25 * 2 * 1e9))
    assert got["perf/tflops_per_device/update"] == pytest.approx(got["perf/mfu/update"] * 1e9 / 1e12)
    assert "perf/mfu/ref" not in got  # no reference pass timed: nothing claimed
    # an update over more rows than the step sampled (SPIN's chosen rows) counts the rows it trained on
    more = step.metrics(lengths, {"perf/update_s": 0.5, "perf/old_log_prob_s": 0.25}, [*lengths, 5, 5, 5])
    assert more["perf/mfu/update"] == pytest.approx(2 * train_flops(cfg, [*lengths, 5, 5, 5]) / (0.5 * 2 * 1e9))
    assert more["perf/mfu/update"] > got["perf/mfu/update"] and more["perf/mfu/log_prob"] == got["perf/mfu/log_prob"]
