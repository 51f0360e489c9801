"""LoRA on the Megatron engine against Hugging Face + peft in float64.

Random adapters (B non-zero, so every adapter changes the output) on every attention and MLP
linear of the tiny Qwen3-MoE (experts included) and the tiny dense Qwen3, under TP=2 with
sequence parallel (fused QKV and gate/up split over ranks; the dense model without it) and EP=2 (experts' adapters on their
own ranks). Tolerances (fp32 Megatron against float64 references):
- log-probs: 3e-5 absolute (observed up to 2.4e-6, 1.3e-5 on the 4-layer model: the adapters are
  large, 0.2 x N(0, 1), so the log-probs reach -6);
- adapter gradients of the mean response NLL: 2e-5 of the largest gradient (0.3 .. 1.2; observed
  up to 1.1e-5 of it: fp32 rounding of the dense model's lm_head adapter), 5e-5 on the 4-layer
  model (observed 2.4e-5, as HF + peft's own float32 run: the first layer's adapters);
- merged HF weights against peft's merge_and_unload: 1e-6 absolute;
- PEFT folder, checkpoint TP=2 -> EP=2 and adapter state round trips: exact.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests._dist import run_ranks
from tests.engine.test_megatron_engine import SEQ_ROWS, make_rows

# the output head too (untied): the log-prob head reads W + scale B A
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
RANK, ALPHA = 4, 8.0


def _engine(path, tp=1, ep=1, distributed_optimizer=False, targets=TARGETS, sequence_parallel=True, **more):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine
    from megarl.engine.megatron.lora import LoraSpec

    engine = MegatronEngine(
        EngineSpec(
            model_path=path,
            parallel=ParallelConfig(
                tp=tp, ep=ep, sequence_parallel=tp > 1 and sequence_parallel, **more.pop("layout", {})
            ),
            optim=OptimConfig(lr=1e-2, adam_eps=1e-2, clip_grad=0.0, use_distributed_optimizer=distributed_optimizer),
            micro_batch_size=2,
            seed=1,
            lora=LoraSpec(rank=RANK, alpha=ALPHA, target_modules=targets),
            **more,
        )
    )
    engine.initialize()
    return engine


def _random_adapters(engine, seed: int) -> dict:
    from megarl.engine.megatron import lora_io

    g = torch.Generator().manual_seed(seed)
    shapes = lora_io.adapter_state(engine.bare_chunks())
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64).float() * 0.2 for k, v in sorted(shapes.items())}


def _nll(logp, ent, mb):
    mask = mb["response_mask"]
    return -(logp * mask).sum(), mask.sum(), {}


def _grads(engine) -> dict:
    """The adapters' reduced gradients (main_grad), full and PEFT-named."""
    from megarl.engine.megatron import lora_io

    params = [p for chunk in engine.bare_chunks() for p in chunk.parameters() if p.requires_grad]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad
        return lora_io.adapter_state(engine.bare_chunks())
    finally:
        for p, data in zip(params, saved):
            p.data = data


def _run(engine, adapters: dict) -> dict:
    """Log-probs, then one Adam step's gradients, with `adapters` loaded."""
    from megarl.engine.megatron import lora_io

    lora_io.load_adapter_state(engine.bare_chunks(), adapters)
    out = engine.compute_log_prob(make_rows())
    frozen = {n: p.detach().clone() for c in engine.bare_chunks() for n, p in c.named_parameters() if ".lora." not in n}
    engine.train_mini_batch(make_rows(), _nll)
    after = {n: p for c in engine.bare_chunks() for n, p in c.named_parameters() if ".lora." not in n}
    return {
        "log_probs": None if out is None else out["log_probs"],
        "grads": _grads(engine),
        "base_unchanged": all(torch.equal(frozen[n], after[n]) for n in frozen),
        "stepped": lora_io.adapter_state(engine.bare_chunks()),
    }


def _optimizer_params(engine) -> dict:
    optimized = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    named = {n: p for c in engine.bare_chunks() for n, p in c.named_parameters()}
    trainable = {n for n, p in named.items() if p.requires_grad}
    return {
        "trainable": sorted(trainable),
        "optimizer_numel": sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]),
        # the distributed optimizer holds fp32 shards of the main params: count them by the model's
        "adapter_numel": sum(named[n].numel() for n in trainable),
        "optimizer_is_adapters": optimized <= {id(named[n]) for n in trainable}
        or engine.spec.optim.use_distributed_optimizer,
    }


def _ranks(rank, paths, ckpt_dir, peft_dir):
    from megatron.core import parallel_state as ps

    from megarl.engine.megatron import lora_io

    out = {}
    moe = _engine(paths["moe"], tp=2)
    adapters = _random_adapters(moe, seed=3)
    out["adapters"] = adapters
    out["tp2"] = _run(moe, adapters)
    out["tp2/merged"] = {k: v.clone() for k, v in moe.export_weights()}
    out["tp2/peft"] = lora_io.write_peft_folder(moe.bare_chunks(), moe.spec.lora, paths["moe"], peft_dir, rank == 0)
    out["tp2/saved"] = lora_io.adapter_state(moe.bare_chunks())
    ps.destroy_model_parallel()

    distributed = _engine(paths["moe"], ep=2, distributed_optimizer=True)
    out["ep2/optimizer"] = _optimizer_params(distributed)
    out["ep2/distributed_step"] = _run(distributed, adapters)["stepped"]
    distributed.save_checkpoint(ckpt_dir)
    ps.destroy_model_parallel()

    resumed = _engine(paths["moe"], tp=2, distributed_optimizer=True)
    out["tp2/resume_info"] = resumed.load_checkpoint(ckpt_dir)
    out["tp2/resumed"] = lora_io.adapter_state(resumed.bare_chunks())
    ps.destroy_model_parallel()

    out["ep2"] = _run(_engine(paths["moe"], ep=2), adapters)
    ps.destroy_model_parallel()

    # without sequence parallel: the adapters' other collectives (h reduced over TP, not scattered)
    dense = _engine(paths["dense"], tp=2, sequence_parallel=False)
    out["dense_adapters"] = _random_adapters(dense, seed=4)
    out["dense_tp2"] = _run(dense, out["dense_adapters"])
    ps.destroy_model_parallel()

    # a layer per pipeline stage, each recomputed in backward (the hook runs again on the recompute)
    out["pp2"] = _run(_engine(paths["moe"], layout={"pp": 2}, recompute="full"), adapters)
    ps.destroy_model_parallel()
    # interleaved: 4 layers on 2 stages x 2 virtual stages (rank 0 holds layers 0 and 2)
    deep = _engine(paths["deep"], layout={"pp": 2, "vpp": 2})
    out["deep_adapters"] = _random_adapters(deep, seed=5)
    out["vpp"] = _run(deep, out["deep_adapters"])
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    from megarl.models.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("lora")
    return {
        "moe": str(build_tiny_checkpoint(root / "moe", seed=0, preset="tiny-qwen3-moe")),
        "dense": str(build_tiny_checkpoint(root / "dense", seed=0, preset="tiny-qwen3")),
        "deep": str(build_tiny_checkpoint(root / "deep", seed=0, preset="tiny-qwen3", num_hidden_layers=4)),
        "ckpt": str(root / "ckpt"),
        "peft": str(root / "peft"),
    }


@pytest.fixture(scope="module")
def results(paths) -> list[dict]:
    return run_ranks(_ranks, 2, paths, paths["ckpt"], paths["peft"])


# ------------------------------------------------------------------ references
def _peft_model(path, adapters: dict, targets=TARGETS):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).double()
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(targets)))
    missing = set_peft_model_state_dict(model, {k: v.double() for k, v in adapters.items()}).unexpected_keys
    assert not missing, missing
    return model


def _reference(path, adapters: dict, targets=TARGETS):
    """float64 log-probs of the rows and the adapters' gradients of the mean response NLL."""
    model = _peft_model(path, adapters, targets)
    logps, nll, tokens = [], 0.0, 0
    for p, r in SEQ_ROWS:
        logp = torch.log_softmax(model(input_ids=torch.tensor([p + r])).logits[0], -1)
        picked = torch.stack([logp[len(p) - 1 + j, tok] for j, tok in enumerate(r)])
        logps.append(picked.detach())
        nll, tokens = nll - picked.sum(), tokens + len(r)
    (nll / tokens).backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:  # peft's names: ...q_proj.lora_A.default.weight; an expert no token
            # was routed to has no gradient in HF (Megatron's is zero)
            grad = torch.zeros_like(param) if param.grad is None else param.grad
            grads[name.replace(".default.weight", ".weight")] = grad
    out = torch.zeros(len(SEQ_ROWS), max(len(r) for _, r in SEQ_ROWS), dtype=torch.float64)
    for i, row in enumerate(logps):
        out[i, : len(row)] = row
    return out, grads, model


def _close(got: dict, want: dict) -> float:
    """The largest absolute difference between two dicts of tensors with the same keys."""
    assert set(got) == set(want), set(got) ^ set(want)
    return max((got[k].double() - want[k].double()).abs().max().item() for k in got)


def _largest(tensors: dict) -> float:
    return max(v.abs().max().item() for v in tensors.values())


@pytest.fixture(scope="module")
def moe_reference(paths, results):
    return _reference(paths["moe"], results[0]["adapters"])


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2"])
def test_lora_log_probs_and_gradients_equal_hf_peft(results, moe_reference, layout):
    want_logp, want_grads, _ = moe_reference
    got = next(r[layout] for r in results if r[layout]["log_probs"] is not None)  # the last stage's
    assert (got["log_probs"].double() - want_logp).abs().max() < 3e-5
    assert len(want_grads) == 2 * (2 * (4 + 4 * 3) + 1)  # (A, B) x (2 layers x (q, k, v, o + 4 experts x 3) + lm_head)
    assert max(v.abs().max() for v in want_grads.values()) > 0.05
    assert _close(got["grads"], want_grads) < 2e-5 * _largest(want_grads)
    assert got["base_unchanged"]
    assert _close(got["stepped"], results[0]["adapters"]) > 1e-3  # the adapters did move


@pytest.mark.parametrize("model, layout", [("dense", "dense_tp2"), ("deep", "vpp")])
def test_dense_lora_under_tp2_and_vpp_equals_hf_peft(results, paths, model, layout):
    want_logp, want_grads, _ = _reference(paths[model], results[0][f"{model}_adapters"])
    got = next(r[layout] for r in results if r[layout]["log_probs"] is not None)  # the last stage's
    assert (got["log_probs"].double() - want_logp).abs().max() < 3e-5
    # float32 through four layers: HF + peft itself in float32 is 1.2e-4 (2.5e-5 of the largest)
    # off its float64 gradients of the deep model's first layer; a wrong scale or a missed
    # adapter is off by the gradient's own size
    assert _close(got["grads"], want_grads) < 5e-5 * _largest(want_grads)


def test_the_distributed_optimizer_holds_only_adapters(results):
    # the same Adam step as TP=2's plain optimizer from the same adapters and gradients
    assert _close(results[0]["ep2/distributed_step"], results[0]["tp2"]["stepped"]) < 1e-6
    opt = results[0]["ep2/optimizer"]
    assert opt["trainable"] and all(".lora.parts." in n for n in opt["trainable"])
    assert opt["optimizer_is_adapters"]
    # rank 0 of EP=2 holds 2 of the 4 experts: 2 layers x (q,k,v,o + 2 experts x 3 MLP linears)
    per_adapter = {"q": 64 * 4 + 64 * 4, "k": 64 * 4 + 32 * 4, "v": 64 * 4 + 32 * 4, "o": 64 * 4 + 64 * 4}
    experts = 2 * 3 * (64 * 4 + 64 * 4)
    assert opt["adapter_numel"] == 2 * (sum(per_adapter.values()) + experts) + (64 * 4 + 64 * 4)  # + lm_head


def test_checkpoint_ep2_resumes_into_tp2_with_adapters_only(results, paths):
    saved, resumed = results[0]["ep2/distributed_step"], results[0]["tp2/resumed"]
    assert set(saved) == set(resumed) and all(torch.equal(saved[k], resumed[k]) for k in saved)
    assert results[0]["tp2/resume_info"]["optimizer"]
    meta = json.load(open(f"{paths['ckpt']}/megarl_ckpt.json"))
    assert meta["lora"]["base"] == paths["moe"] and meta["lora"]["rank"] == RANK
    # the base is named, not copied: every tensor in the checkpoint is an adapter's (or its state)
    from megatron.core.dist_checkpointing import load_tensors_metadata

    keys = set(load_tensors_metadata(paths["ckpt"]))
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), sorted(keys)[:5]
    assert any(k.startswith("optimizer.") for k in keys)


def test_peft_folder_loads_onto_the_hf_base(results, paths, moe_reference):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    written = load_file(f"{paths['peft']}/adapter_model.safetensors")
    saved = results[0]["tp2/saved"]
    assert set(written) == set(saved) and all(torch.equal(written[k], saved[k]) for k in saved)
    config = json.load(open(f"{paths['peft']}/adapter_config.json"))
    assert sorted(config["target_modules"]) == sorted(TARGETS) and config["r"] == RANK
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(paths["moe"]), paths["peft"]).double()
    reference = _peft_model(paths["moe"], saved)
    ids = torch.tensor([SEQ_ROWS[0][0] + SEQ_ROWS[0][1]])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-6)


def test_merged_export_equals_peft_merge(results, paths):
    merged = _peft_model(paths["moe"], results[0]["tp2/saved"]).merge_and_unload().state_dict()
    got = results[0]["tp2/merged"]
    assert set(got) <= set(merged)
    assert _close(got, {k: merged[k] for k in got}) < 1e-6
    from safetensors.torch import load_file

    base = load_file(f"{paths['moe']}/model.safetensors")
    changed = {k for k in got if not torch.equal(got[k], base[k])}
    assert changed and all(any(t in k for t in TARGETS) for k in changed)
