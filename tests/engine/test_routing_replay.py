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

NOISE = 1e-2  # added to the trainer's router weights: flips some tokens' top-k choices
EXPERT_SCALE = 8.0  # expert down-projections scaled up so an expert flip moves the log-probs
PROMPTS = [[2, 10, 11, 12, 3], [2, 20, 21, 3], [2, 30, 3], [2, 40, 41, 42, 43, 44, 3]]


@pytest.fixture(scope="module")
def moe_paths(tiny_model_path, tmp_path_factory):
    """(server checkpoint, trainer checkpoint): the tiny Qwen3-MoE with experts that matter, and the
    same with router weights perturbed by NOISE (the trainer's router differs slightly)."""
    return server_and_trainer_checkpoints(tiny_model_path, tmp_path_factory.mktemp("routing"))


def server_and_trainer_checkpoints(base, root) -> tuple:
    """Copies of checkpoint `base` under `root`: expert down-projections x EXPERT_SCALE, and the
    trainer's with router weights + N(0, NOISE) (also benchmarks/gpu_replay.py's setting)."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    out = []
    for name, noise in (("server", 0.0), ("trainer", NOISE)):
        path = Path(root) / name
        shutil.copytree(base, path)
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
    from megarl.rollout.engine.generation import GenerationEngine
    from megarl.rollout.server.generate_input import parse_generate
    from megarl.rollout.server.generate_output import output_item

    engine = GenerationEngine(str(moe_paths[0]), max_batch_size=16, seed=0)
    try:
        body = {
            "input_ids": PROMPTS,
            "return_logprob": True,
            "return_routed_experts": True,
            "sampling_params": {"n": 2, "max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3},
        }
        call = parse_generate(body, engine)
        results = [f.result(timeout=120) for f in engine.submit(call.requests)]
        items = [output_item(r, q, call, str) for r, q in zip(results, call.requests)]
        return {
            "items": items,
            "results": results,
            "requests": call.requests,
            "layers": engine.model.config.num_hidden_layers,
            "top_k": engine.model.config.num_experts_per_tok,
        }
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
    from megarl.wire import routing

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


def test_routed_experts_start_len_http_route_and_dense_model_refusal(moe_paths, tmp_path):
    from fastapi.testclient import TestClient

    from megarl.models.tiny import build_tiny_checkpoint
    from megarl.rollout.engine.generation import GenerationEngine
    from megarl.rollout.engine.protocol import InvalidRequest
    from megarl.rollout.server.app import create_app
    from megarl.rollout.server.generate_input import parse_generate
    from megarl.rollout.server.generate_output import output_item
    from megarl.wire import routing

    engine = GenerationEngine(str(moe_paths[0]), seed=0)
    try:
        body = {
            "input_ids": PROMPTS[0],
            "return_routed_experts": True,
            "routed_experts_start_len": 3,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        }
        whole = dict(body, routed_experts_start_len=0)
        items = []
        for b in (body, whole):
            call = parse_generate(b, engine)
            result = engine.submit(call.requests)[0].result(timeout=60)
            items.append((output_item(result, call.requests[0], call, str), result))
        (cut, result), (full, _) = items
        tokens = len(PROMPTS[0]) + len(result.output_ids) - 1
        whole_records = routing.decode(full["meta_info"]["routed_experts"], tokens)
        np.testing.assert_array_equal(routing.decode(cut["meta_info"]["routed_experts"], tokens - 3), whole_records[3:])
        http = TestClient(create_app(engine)).post("/generate", json=whole).json()  # the server's route
        np.testing.assert_array_equal(
            routing.decode(http["meta_info"]["routed_experts"], tokens),
            routing.decode(full["meta_info"]["routed_experts"], tokens),
        )
    finally:
        engine.close()
    dense = GenerationEngine(str(build_tiny_checkpoint(tmp_path / "dense", seed=0, preset="tiny-qwen3")))
    try:
        with pytest.raises(InvalidRequest, match="no MoE router"):
            parse_generate({"input_ids": [2, 3], "return_routed_experts": True}, dense)
    finally:
        dense.close()


# ---------------------------------------------------------------- the trainer replays them
def served_batch(served):
    """The rollout rows as the trainer gets them (manager.rows_to_batch, through the wire format)."""
    from megarl.rollout.client.client import GenerateOutput
    from megarl.rollout.client.manager import rows_to_batch

    rows = [
        (req.input_ids, GenerateOutput.from_response(item)) for item, req in zip(served["items"], served["requests"])
    ]
    return rows_to_batch(rows, routed_experts=True)


def _engine(model_path, replay: bool, train: bool = False, parallel=None, packed=True, recompute="none"):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    engine = MegatronEngine(
        EngineSpec(
            model_path=str(model_path),
            parallel=parallel or ParallelConfig(),
            micro_batch_size=3,
            seed=1,
            optim=OptimConfig(lr=1e-3, adam_eps=1e-2, clip_grad=0.0) if train else None,
            pack_sequences=packed,
            routing_replay=replay,
            recompute=recompute,
        )
    )
    engine.initialize()
    return engine


def _without_records(batch):
    return batch.select(*[k for k in batch.keys() if k != "routed_experts"])


def _log_probs_on_rank(rank, paths, batch, parallel_kwargs, with_free=True):
    """{(checkpoint, layout, replay): log-probs} for each path, packed (and right-padded with
    replay on the first path); empty off the last pipeline stage."""
    from megarl.config.schema import ParallelConfig

    p = ParallelConfig(**parallel_kwargs, sequence_parallel=parallel_kwargs.get("tp", 1) > 1)
    runs = [(i, "packed", replay) for i in range(len(paths)) for replay in ((False, True) if with_free else (True,))]
    out = {}
    for i, layout, replay in runs + ([(0, "padded", True)] if with_free else []):
        engine = _engine(paths[i], replay, parallel=p, packed=layout == "packed")
        result = engine.compute_log_prob(batch if replay else _without_records(batch))
        if result is not None:
            out[(i, layout, replay)] = result["log_probs"]
    return out


def _train_on_rank(rank, model_path, batch):
    """One update with replay, without and with full recompute: the log-probs the loss saw, the
    grad norm, the router weights before and after."""
    from megarl.algo.losses import policy_loss

    out = {}
    for recompute in ("none", "full"):
        engine = _engine(model_path, True, train=True, recompute=recompute)
        gates = lambda: {k: v.clone() for k, v in engine.export_weights() if k.endswith("mlp.gate.weight")}  # noqa: E731
        before, seen = gates(), []

        def loss_fn(logp, ent, mb):
            seen.append(logp.detach())
            mask = mb["response_mask"]
            loss, _ = policy_loss(logp, logp.detach(), mb["advantages"], mask, global_denominator=1.0)
            return loss, mask.sum(), {}

        metrics = engine.train_mini_batch(batch, loss_fn)
        out[recompute] = {
            "grad_norm": metrics["actor/grad_norm"],
            "before": before,
            "after": gates(),
            "log_probs": torch.cat(seen),
        }
    return out


def hf_forced_log_probs(model_path, batch) -> torch.Tensor:
    """Hugging Face in float64 with every MoE block routing token t to batch["routed_experts"]'s
    experts (its own top-k where the record is -1), probabilities from its own router, as R3
    prescribes: the independent reference for the replaying trainer. [B, R]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).double().eval()
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    assert model.config.norm_topk_prob
    out = torch.zeros(batch["response_mask"].shape, dtype=torch.float64)
    for i in range(len(batch)):
        P, R = int(batch["prompt_lengths"][i]), int(batch["response_mask"][i].sum())
        ids = batch["input_ids"][i, : P + R]
        forced = batch["routed_experts"][i, : P + R].long().view(P + R, layers, k)
        for layer, block in enumerate(model.model.layers):
            block.mlp.forward = _forced_moe(block.mlp, forced[:, layer])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0], -1)
        out[i, :R] = logp[P - 1 : P + R - 1].gather(1, ids[P:, None])[:, 0]
    return out


def _forced_moe(block, forced):
    def forward(hidden):
        h = hidden.reshape(-1, hidden.shape[-1])
        logits = block.gate(h)
        probs = torch.softmax(logits, -1)
        index = torch.where(forced < 0, probs.topk(block.top_k, -1).indices, forced)
        weights = probs.gather(1, index)
        weights = weights / weights.sum(-1, keepdim=True)
        every = torch.stack([expert(h) for expert in block.experts], 1)  # [tokens, experts, hidden]
        chosen = every.gather(1, index[..., None].expand(-1, -1, h.shape[-1]))
        return (weights[..., None] * chosen).sum(1).view_as(hidden), logits

    return forward


@pytest.fixture(scope="module")
def one_rank(moe_paths, served):
    """Log-probs of the served rows on one rank: the trainer's checkpoint (perturbed router) without
    and with replay, packed and right-padded; the server's own checkpoint without and with replay."""
    batch = served_batch(served)
    out = run_ranks(_log_probs_on_rank, 1, [moe_paths[1], moe_paths[0]], batch, {})[0]
    return {
        "batch": batch,
        "free": out[(0, "packed", False)],
        "replayed": out[(0, "packed", True)],
        "padded": out[(0, "padded", True)],
        "same_free": out[(1, "packed", False)],
        "same_replayed": out[(1, "packed", True)],
    }


def _diff(a, b, mask):
    return ((a.double() - b.double()).abs() * mask).max().item()


def test_replay_equals_hugging_face_with_forced_experts(one_rank, moe_paths):
    """The trainer's router differs (NOISE): replayed, Megatron routes exactly as the server did
    and takes its own router's probabilities there, which HF with forced experts computes too."""
    b = one_rank["batch"]
    mask = b["response_mask"]
    reference = hf_forced_log_probs(moe_paths[1], b)
    assert _diff(one_rank["replayed"], reference, mask) < 1e-5
    assert _diff(one_rank["padded"], reference, mask) < 1e-5  # right-padded rows replay the same
    assert _diff(one_rank["free"], reference, mask) > 1e-2  # without replay some experts flipped


def test_replay_removes_the_routing_mismatch(one_rank, capsys):
    """Server vs trainer, as the loop's parity check and corrections.mismatch_metrics see them:
    with the same weights replay changes nothing (parity 1e-5); with the trainer's router perturbed
    the expert flips dominate without replay, and replay removes them. rollout/mismatch_kl (a
    signed k1 mean) is printed, not asserted: over this batch's ~40 tokens its sampling noise is as
    large as the KL itself; the per-token non-negative k3 estimate of the same KL is asserted."""
    from types import SimpleNamespace

    from megarl.algo.corrections import mismatch_metrics
    from megarl.algo.kl import kl_penalty
    from megarl.algo.losses import masked_mean
    from megarl.trainer.parity import check_parity

    b = one_rank["batch"]
    mask, rollout = b["response_mask"], b["rollout_log_probs"]
    assert _diff(one_rank["same_free"], rollout, mask) < 1e-5
    assert _diff(one_rank["same_replayed"], rollout, mask) < 1e-5
    bridge = SimpleNamespace(parity_atol=1e-2, parity_rows_off=1.0, check_parity=False)
    metrics = {}
    for name in ("free", "replayed"):
        rows = b.select("response_mask", "rollout_log_probs")
        rows["old_log_probs"] = one_rank[name]
        metrics[name] = {
            **check_parity(rows, 0, bridge, 1, lambda: []),
            **{k: float(v) for k, v in mismatch_metrics(one_rank[name], rollout, mask).items()},
            "k3_kl": float(masked_mean(kl_penalty(rollout, one_rank[name], "k3"), mask)),
        }
    with capsys.disabled():
        print(f"\nrouting replay, server vs trainer (router weights + N(0, {NOISE:g})):")
        for name, m in metrics.items():
            print(f"  {name:9s} " + ", ".join(f"{k}={v:.3g}" for k, v in sorted(m.items())))
    free, replayed = metrics["free"], metrics["replayed"]
    assert free["rollout/logprob_diff_mean"] > 3 * replayed["rollout/logprob_diff_mean"]
    assert free["rollout/logprob_diff_max"] > 3 * replayed["rollout/logprob_diff_max"]
    assert free["rollout/logprob_rows_off"] > replayed["rollout/logprob_rows_off"]
    assert free["k3_kl"] > 10 * replayed["k3_kl"]


@pytest.mark.parametrize("layout", [dict(tp=2, ep=2), dict(cp=2), dict(pp=2)], ids=["tp2-ep2-sp", "cp2", "pp2"])
def test_replay_follows_the_tokens_across_layouts(one_rank, moe_paths, layout):
    """Sequence parallel slices, the CP split, expert parallel dispatch and pipeline stages: every
    layout replays the same experts, so its log-probs equal one rank's."""
    results = run_ranks(_log_probs_on_rank, 2, [moe_paths[1]], one_rank["batch"], layout, False)
    mask = one_rank["batch"]["response_mask"]
    replayed = [r[(0, "packed", True)] for r in results if r][0]
    assert _diff(replayed, one_rank["replayed"], mask) < 1e-5


def test_update_replays_and_trains_the_router(one_rank, moe_paths):
    """The update's forward replays too (its log-probs equal compute_log_prob's), the step is finite,
    the router weights move (their gradient flows through the replayed probabilities), and full
    recompute replays the same experts in the backward pass (same grad norm and weights)."""
    b = one_rank["batch"]
    rows = b.select(*b.keys())
    rows["advantages"] = torch.linspace(-1, 1, len(b))[:, None] * b["response_mask"]
    out = run_ranks(_train_on_rank, 1, moe_paths[1], rows)[0]
    plain, recomputed = out["none"], out["full"]
    assert _diff(plain["log_probs"], one_rank["replayed"], b["response_mask"]) < 1e-5
    assert np.isfinite(plain["grad_norm"]) and plain["grad_norm"] > 0
    assert all((plain["after"][k] - plain["before"][k]).abs().max() > 1e-6 for k in plain["before"])
    assert abs(recomputed["grad_norm"] - plain["grad_norm"]) <= 1e-5 * plain["grad_norm"]
    for k in plain["after"]:
        assert (recomputed["after"][k] - plain["after"][k]).abs().max() < 1e-6


# ---------------------------------------------------------------- config and batch plumbing
def test_config_refuses_routing_replay_on_a_dense_model():
    from megarl.config import ConfigError, load_config, validate
    from megarl.models.tiny import TINY_QWEN3_MOE
    from megarl.models.tiny_archs import TINY_QWEN3

    cfg = load_config(None, ["actor.moe.routing_replay=true"])
    assert validate(cfg, TINY_QWEN3_MOE).actor.moe.routing_replay
    with pytest.raises(ConfigError, match=r"actor\.moe\.routing_replay.*dense"):
        validate(cfg, TINY_QWEN3)


def test_generation_rounds_pad_routed_experts_with_no_record():
    """DAPO's rounds of different widths: the records are padded with -1, not expert 0."""
    from megarl.data.batch import Batch
    from megarl.trainer.dynamic_sampling import _concat

    parts = [
        Batch(
            {
                "input_ids": torch.ones(2, T, dtype=torch.long),
                "routed_experts": torch.full((2, T, 4), 3, dtype=torch.int16),
            }
        )
        for T in (3, 5)
    ]
    rows = _concat(parts)
    assert rows["routed_experts"].shape == (4, 5, 4) and rows["input_ids"].shape == (4, 5)
    assert (rows["routed_experts"][:2, 3:] == -1).all() and (rows["routed_experts"][:2, :3] == 3).all()
    assert (rows["input_ids"][:2, 3:] == 0).all()


def test_replay_refuses_rows_without_records(one_rank, moe_paths):
    with pytest.raises(RuntimeError, match="has no 'routed_experts' column"):
        run_ranks(_log_probs_on_rank, 1, [moe_paths[1]], _without_records(one_rank["batch"]), {}, False)


def test_routed_requests_bypass_sglang_router():
    """sglang-router 0.3.2 drops return_routed_experts from the body it forwards (seen with a stub
    worker behind RouterProcess), so those requests go to the engines, each its share batched."""
    from types import SimpleNamespace

    from megarl.rollout.client.manager import RolloutManager, SamplingSpec

    fleet = SimpleNamespace(router_url="http://router:1", live_urls=lambda: ["http://e0:1", "http://e1:1"])
    manager = RolloutManager(fleet=fleet)
    try:
        prompts = [[2, 3]] * 4
        routed = manager._requests([0, 1, 2, 3], prompts, SamplingSpec(n=2, return_routed_experts=True))
        plain = manager._requests([0, 1, 2, 3], prompts, SamplingSpec(n=2))
        assert sorted(c.base_url for c, *_ in routed) == ["http://e0:1", "http://e1:1"]
        assert {c.base_url for c, *_ in plain} == {"http://router:1"}
    finally:
        manager.close()
