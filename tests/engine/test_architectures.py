"""Qwen2, Qwen3, Llama and DeepSeek-V3 through mbridge with the local spec: parity with Hugging Face.

Tiny random checkpoints (megarl/models/tiny_archs.py; norm weights and biases random too, so a
dropped or swapped mapping shows). Two process groups do all the Megatron work: one rank (TP=1
training references) and two ranks (TP=2 for every architecture, then EP=2 for DeepSeek-V3).

Tolerances (fp32 Megatron; references in float64 except HF DeepSeek-V3's router, which computes its
scores in fp32 by design, as Megatron's does):
- log-probs vs Hugging Face: 1e-5 absolute (observed 2.4e-7 .. 3.8e-7);
- HF -> Megatron -> HF weights and the reshard pieces: exact (torch.equal);
- one Adam step (lr 1e-3, eps 1e-2: the update is a smooth function of the gradient), TP=2 / EP=2
  vs TP=1: gradients 1e-5 absolute against a largest gradient of 0.57 (observed 1.5e-7), weights
  after the step 1e-6 absolute (observed 7e-9).
The SILENT failures each have a test that shows it would fail without the fix: group-limited
routing (without it: 5.4e-2 off HF), TP>1 gradients of MLA's rope key (stock: 1.5e-2 off, largest
1.1e-1) and, without sequence parallel, of MLA's q_layernorm (stock: doubled).
"""

from __future__ import annotations

import types

import pytest
import torch

from megarl.models.tiny_archs import TINY_DEEPSEEK_V3
from tests._dist import run_ranks
from tests.bridge.test_bridge import _check_pieces_rebuild_the_model
from tests.engine.test_megatron_engine import SEQ_ROWS, make_rows

DENSE = ["tiny-qwen2", "tiny-qwen3", "tiny-llama"]
DSV3 = "tiny-deepseek-v3"
DSV3_DENSE = "tiny-deepseek-v3-dense"  # all layers dense: MLA trained with TP=2 and no SP


@pytest.fixture(scope="module")
def arch_paths(tmp_path_factory) -> dict:
    from megarl.models.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("archs")
    paths = {name: str(build_tiny_checkpoint(root / name, seed=0, preset=name)) for name in DENSE + [DSV3]}
    paths[DSV3_DENSE] = str(build_tiny_checkpoint(root / DSV3_DENSE, seed=0, preset=DSV3, first_k_dense_replace=3))
    return paths


# ------------------------------------------------------------------ rank-side work
def _engine(path, tp=1, ep=1, train=False, sequence_parallel=None, cp=1):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    sp = tp > 1 if sequence_parallel is None else sequence_parallel
    engine = MegatronEngine(
        EngineSpec(
            model_path=path,
            parallel=ParallelConfig(tp=tp, ep=ep, cp=cp, sequence_parallel=sp),
            # the distributed optimizer leaves a rank only its shard of the reduced gradient in
            # main_grad; the plain one all-reduces it whole, which _hf_gradients reads
            optim=OptimConfig(lr=1e-3, adam_eps=1e-2, clip_grad=0.0, use_distributed_optimizer=False)
            if train
            else None,
            micro_batch_size=2,
            seed=1,
        )
    )
    engine.initialize()
    return engine


def _forward(path, **layout):
    engine = _engine(path, **layout)
    return {
        "log_probs": engine.compute_log_prob(make_rows())["log_probs"],
        "weights": dict(engine.export_weights()),
        # what the reshard bridge plans from: the HF boxes this rank's shards produce
        "pieces": [(p.name, p.box, p.fetch().clone()) for p in engine.local_pieces()],
    }


def _hf_gradients(engine) -> dict:
    """The reduced gradients (DDP's main_grad) as full HF-named tensors, via the weight export."""
    params = [p for chunk in engine.bare_chunks() for p in chunk.parameters()]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad
        # the router's expert bias is a buffer (no gradient): the export would give its value
        return {k: v.clone() for k, v in engine.export_weights() if not k.endswith("e_score_correction_bias")}
    finally:
        for p, data in zip(params, saved):
            p.data = data


def _train(path, **layout):
    from megarl.algo.losses import policy_loss

    engine = _engine(path, train=True, **layout)

    def loss_fn(logp, ent, mb):
        mask = mb["response_mask"]
        loss, _ = policy_loss(logp, logp.detach(), mb["advantages"], mask, global_denominator=1.0)
        return loss, mask.sum(), {}

    engine.train_mini_batch(make_rows(), loss_fn)
    return {"grads": _hf_gradients(engine), "weights": {k: v.clone() for k, v in engine.export_weights()}}


def _one_rank(rank, paths):
    return {"tp1/train": _train(paths[DSV3]), "tp1/dense_train": _train(paths[DSV3_DENSE])}


def _two_ranks(rank, paths):
    from megatron.core import parallel_state as ps

    from megarl.engine.megatron import model

    out = {f"tp2/{name}": _forward(paths[name], tp=2) for name in DENSE + [DSV3]}
    out["tp2/train"] = _train(paths[DSV3], tp=2)
    out["tp2/dense_train_no_sp"] = _train(paths[DSV3_DENSE], tp=2, sequence_parallel=False)
    # what the fixes replace, to show the tests below would catch their absence
    fixed_mla, fixed_routing = model.use_local_mla, model._routing_args
    model.use_local_mla, model._routing_args = (lambda spec: spec), (lambda hf_config: {})
    try:
        out["tp2/stock_mla_train"] = _train(paths[DSV3], tp=2)
        out["tp2/no_group_routing"] = _forward(paths[DSV3], tp=2)
    finally:
        model.use_local_mla, model._routing_args = fixed_mla, fixed_routing
    ps.destroy_model_parallel()
    out[f"ep2/{DSV3}"] = _forward(paths[DSV3], ep=2)
    out["ep2/train"] = _train(paths[DSV3], ep=2)
    ps.destroy_model_parallel()
    # MLA under context parallel, packed: each sequence split into 4 chunks, K/V gathered over CP
    out["cp2/train"] = _train(paths[DSV3], cp=2)
    return out


@pytest.fixture(scope="module")
def per_rank(arch_paths) -> list[dict]:
    """The two-rank results of both ranks; the one-rank results merged into rank 0's."""
    one = run_ranks(_one_rank, 1, arch_paths)[0]
    two = run_ranks(_two_ranks, 2, arch_paths)
    return [{**one, **two[0]}, two[1]]


@pytest.fixture(scope="module")
def results(per_rank) -> dict:
    return per_rank[0]


# ------------------------------------------------------------------ references
def hf_log_probs(path, **config_overrides) -> torch.Tensor:
    """Response log-probs from the Hugging Face model in float64 (DeepSeek-V3's router: fp32)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    model = AutoModelForCausalLM.from_pretrained(path, **config_overrides).double().eval()
    for module in model.modules():
        if isinstance(module, ds.DeepseekV3TopkRouter):
            # HF's MoE accumulates in the router's dtype; give it the model's
            module.register_forward_hook(lambda m, args, out: (out[0], out[1].to(args[0].dtype)))
    rows = make_rows()
    out = torch.zeros_like(rows["response_mask"], dtype=torch.float64)
    with torch.no_grad():
        for i, (p, r) in enumerate(SEQ_ROWS):
            logp = torch.log_softmax(model(torch.tensor([p + r])).logits[0], -1)
            for j, tok in enumerate(r):
                out[i, j] = logp[len(p) - 1 + j, tok]
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("layout,name", [("tp2", n) for n in DENSE + [DSV3]] + [("ep2", DSV3)])
def test_log_probs_equal_hugging_face(results, arch_paths, layout, name):
    ref = hf_log_probs(arch_paths[name])
    mask = make_rows()["response_mask"]
    got = results[f"{layout}/{name}"]["log_probs"].double()
    torch.testing.assert_close(got * mask, ref * mask, atol=1e-5, rtol=0)
    assert (ref * mask).abs().sum() > 0


@pytest.mark.parametrize("layout,name", [("tp2", n) for n in DENSE + [DSV3]] + [("ep2", DSV3)])
def test_weight_round_trip_is_exact(results, arch_paths, layout, name):
    from safetensors.torch import load_file

    original = load_file(f"{arch_paths[name]}/model.safetensors")
    exported = results[f"{layout}/{name}"]["weights"]
    assert set(exported) == set(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key


@pytest.mark.parametrize("layout,name", [("tp2", n) for n in DENSE + [DSV3]] + [("ep2", DSV3)])
def test_reshard_pieces_rebuild_the_model(per_rank, layout, name):
    """shards.local_hf_pieces (mbridge's layouts through index tensors) for MLA and the rest."""
    _check_pieces_rebuild_the_model(
        [
            {"full": per_rank[0][f"{layout}/{name}"]["weights"], "pieces": r[f"{layout}/{name}"]["pieces"]}
            for r in per_rank
        ]
    )


@pytest.mark.parametrize("layout", ["tp2", "ep2", "cp2"])
def test_deepseek_v3_train_step_equals_tp1(results, arch_paths, layout):
    from safetensors.torch import load_file

    ref, got = results["tp1/train"], results[f"{layout}/train"]
    assert max(g.abs().max().item() for g in ref["grads"].values()) > 0.1
    assert _max_diff(got["grads"], ref["grads"]) < 1e-5
    assert _max_diff(got["weights"], ref["weights"]) < 1e-6
    before = load_file(f"{arch_paths[DSV3]}/model.safetensors")  # the step moved the weights
    assert sum(not torch.equal(before[k], ref["weights"][k]) for k in before) > len(before) // 2


def test_group_limited_routing_matches_hugging_face(results, arch_paths):
    """SILENT failure 5: without n_group / topk_group Megatron routes over all experts."""
    grouped = hf_log_probs(arch_paths[DSV3])
    ungrouped = hf_log_probs(arch_paths[DSV3], n_group=1, topk_group=1)
    mask = make_rows()["response_mask"]
    assert ((grouped - ungrouped) * mask).abs().max() > 1e-2  # the restriction matters here
    for layout in ("tp2", "ep2"):
        got = results[f"{layout}/{DSV3}"]["log_probs"].double()
        torch.testing.assert_close(got * mask, grouped * mask, atol=1e-5, rtol=0)
    dropped = results["tp2/no_group_routing"]["log_probs"].double()
    assert ((dropped - grouped) * mask).abs().max() > 1e-2


def test_tp2_mla_gradients_equal_tp1(results):
    """SILENT failure 6: the rope key's gradient summed over TP (mla.py), with SP and without."""
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    ref, fixed, stock = (
        results["tp1/train"]["grads"],
        results["tp2/train"]["grads"],
        results["tp2/stock_mla_train"]["grads"],
    )
    rope_rows = ref[key][TINY_DEEPSEEK_V3["kv_lora_rank"] :]  # the latent's rows, then the rope's
    assert rope_rows.abs().max() > 1e-3
    torch.testing.assert_close(fixed[key], ref[key], atol=1e-5, rtol=0)
    assert (stock[key] - ref[key]).abs().max() > 1e-3  # Megatron's local-spec path alone is wrong
    assert _max_diff(results["tp2/dense_train_no_sp"]["grads"], results["tp1/dense_train"]["grads"]) < 1e-5


def test_routing_args_refuse_group_scoring_that_differs_from_hugging_face():
    from megarl.engine.megatron.model import _routing_args

    cfg = types.SimpleNamespace(n_group=4, topk_group=2, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="topk_group"):
        _routing_args(cfg)
    cfg = types.SimpleNamespace(n_group=8, topk_group=4, num_experts_per_tok=8)  # DeepSeek-V3's
    assert _routing_args(cfg) == dict(moe_router_num_groups=8, moe_router_group_topk=4)


def test_schema_presets_are_the_built_presets():
    import typing

    from megarl.config.schema import ModelConfig
    from megarl.models import smollm2, tiny_vlm
    from megarl.models.tiny import PRESETS

    # every preset the schema offers is built in code (the text models, the VLM), or materialised
    # from a package (SmolLM2)
    built = set(PRESETS) | {tiny_vlm.PRESET, smollm2.PRESET}
    assert set(typing.get_args(typing.get_type_hints(ModelConfig)["preset"])) == built
