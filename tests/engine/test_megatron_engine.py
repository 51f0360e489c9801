"""Megatron-core on CPU over gloo: parallel layouts agree with each other and with Hugging Face.

Tolerances: fp32 everywhere; 1e-5 absolute on logits/log-probs (observed ~2e-7), 1e-5 relative
on gradient norms and 1e-6 absolute on weights after one Adam step (lr 1e-3, eps 1e-2, so the
update is a smooth function of the gradient; observed ~1e-9).
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks

SEQ_ROWS = [
    # (prompt tokens, response tokens)
    ([2, 10, 11, 12, 3], [13, 14, 1]),
    ([2, 20, 21, 3], [22, 23, 24, 25, 1]),
    ([2, 30, 3], [31]),
    ([2, 40, 41, 42, 43, 44, 3], [45, 46]),
]


def make_rows():
    from megarl.data.batch import Batch

    T = max(len(p) + len(r) for p, r in SEQ_ROWS)
    R = max(len(r) for _, r in SEQ_ROWS)
    ids = torch.zeros(len(SEQ_ROWS), T, dtype=torch.long)
    resp = torch.zeros(len(SEQ_ROWS), R, dtype=torch.long)
    mask = torch.zeros(len(SEQ_ROWS), R)
    for i, (p, r) in enumerate(SEQ_ROWS):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        resp[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    plen = torch.tensor([len(p) for p, _ in SEQ_ROWS])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1) * mask
    return Batch(
        {"input_ids": ids, "responses": resp, "response_mask": mask, "prompt_lengths": plen, "advantages": adv}
    )


def hf_reference(model_path):
    """log-probs of each row's response tokens from the Hugging Face model, in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).double().eval()
    rows = make_rows()
    out = torch.zeros_like(rows["response_mask"], dtype=torch.float64)
    with torch.no_grad():
        for i, (p, r) in enumerate(SEQ_ROWS):
            logits = model(torch.tensor([p + r])).logits[0]
            logp = torch.log_softmax(logits, -1)
            for j, tok in enumerate(r):
                out[i, j] = logp[len(p) - 1 + j, tok]
    return out


def _engine(model_path, tp, ep, train=False, pp=1, etp=1, dispatcher="alltoall", cp=1, packed=True, max_tokens=None):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    spec = EngineSpec(
        model_path=str(model_path),
        parallel=ParallelConfig(tp=tp, ep=ep, pp=pp, etp=etp, cp=cp, sequence_parallel=tp > 1),
        optim=OptimConfig(lr=1e-3, adam_eps=1e-2, clip_grad=0.0) if train else None,
        micro_batch_size=2,
        seed=1,
        moe_dispatcher=dispatcher,
        pack_sequences=packed,
        max_tokens_per_micro_batch=max_tokens,
    )
    engine = MegatronEngine(spec)
    engine.initialize()
    return engine


def _full_logits(engine, ids):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    T = ids.shape[1]
    ids = torch.nn.functional.pad(ids, (0, engine._padded_length(T) - T))
    with torch.no_grad():
        out = engine.model[0](ids, torch.arange(ids.shape[1]).expand_as(ids), None)[:, :T]
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, -1)


def _forward_on_rank(rank, model_path, tp, ep, pp=1, cp=1):
    """log-probs (None on a rank that is not the last pipeline stage) and, without PP/CP, logits."""
    engine = _engine(model_path, tp, ep, pp=pp, cp=cp)
    rows = make_rows()
    out = engine.compute_log_prob(rows)
    logits = _full_logits(engine, rows["input_ids"]) if pp == 1 and cp == 1 else None
    return {"log_probs": None if out is None else out["log_probs"], "logits": logits}


def _last_stage(results) -> torch.Tensor:
    found = [r["log_probs"] for r in results if r["log_probs"] is not None]
    assert found, "no rank returned log-probs"
    return found[0]


def _train_on_rank(rank, model_path, tp, ep, pp=1, etp=1, dispatcher="alltoall", cp=1, packed=True, max_tokens=None):
    from megarl.algo.losses import policy_loss

    engine = _engine(
        model_path,
        tp,
        ep,
        train=True,
        pp=pp,
        etp=etp,
        dispatcher=dispatcher,
        cp=cp,
        packed=packed,
        max_tokens=max_tokens,
    )
    rows = make_rows()
    before = engine.compute_log_prob(rows)

    def loss_fn(logp, ent, mb):
        mask = mb["response_mask"]
        loss, metrics = policy_loss(logp, logp.detach(), mb["advantages"], mask, global_denominator=1.0)
        return loss, mask.sum(), {"pg_loss": metrics["pg_loss"]}

    metrics = engine.train_mini_batch(rows, loss_fn)
    weights = {k: v.clone() for k, v in engine.export_weights()}
    return {
        "grad_norm": metrics["actor/grad_norm"],
        "weights": weights,
        "log_probs": None if before is None else before["log_probs"],
    }


@pytest.fixture(scope="module")
def train_results(tiny_model_path):
    return {
        "tp1": run_ranks(_train_on_rank, 1, tiny_model_path, 1, 1)[0],  # packed (the default)
        "padded": run_ranks(_train_on_rank, 1, tiny_model_path, 1, 1, 1, 1, "alltoall", 1, False)[0],
        # token budget of 12: the rows (8, 9, 4, 9 tokens) go in 3 micro-batches, not 2 x 2 rows
        "budget": run_ranks(_train_on_rank, 1, tiny_model_path, 1, 1, 1, 1, "alltoall", 1, True, 12)[0],
    }


def test_packed_log_probs_equal_padded_and_hugging_face(train_results, tiny_model_path):
    """THD packing (rows back to back, cu_seqlens, per-sequence RoPE and attention) against the
    right-padded layout and against HF run row by row in float64."""
    packed, padded = train_results["tp1"]["log_probs"], train_results["padded"]["log_probs"]
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed.double(), hf_reference(tiny_model_path), atol=1e-5, rtol=0)
    torch.testing.assert_close(train_results["budget"]["log_probs"], packed, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def forward_results(tiny_model_path):
    return {
        "tp1": run_ranks(_forward_on_rank, 1, tiny_model_path, 1, 1)[0],
        "tp2": run_ranks(_forward_on_rank, 2, tiny_model_path, 2, 1)[0],
        "ep2": run_ranks(_forward_on_rank, 2, tiny_model_path, 1, 2),
        "pp2": run_ranks(_forward_on_rank, 2, tiny_model_path, 1, 1, 2),
        "cp2": run_ranks(_forward_on_rank, 2, tiny_model_path, 1, 1, 1, 2),
    }


def test_cp2_log_probs_equal_cp1(forward_results):
    """Load-balanced CP split (rank r holds chunks r and 3-r), K/V all-gathered in CpuCoreAttention;
    both CP ranks assemble the same full-sequence log-probs."""
    for rank_result in forward_results["cp2"]:
        torch.testing.assert_close(rank_result["log_probs"], forward_results["tp1"]["log_probs"], atol=1e-5, rtol=0)


def _attention_parity_on_rank(rank):
    """CpuCoreAttention against Megatron's local DotProductAttention: GQA, causal, fwd + bwd."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.engine.megatron.cpu import compat as cpu_compat
    from megarl.engine.megatron.cpu.attention import CpuCoreAttention

    cpu_compat.activate()
    ps.initialize_model_parallel(1, 1)
    cpu_compat.seed_model_parallel(0)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
        attention_dropout=0.0,
    )
    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, 2, h, 8, generator=gen) for h in (4, 2, 2))
    outs = []
    for module in (DotProductAttention(**args), CpuCoreAttention(**args)):
        qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
        out = module(qi, ki, vi, None)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append([out.detach(), qi.grad, ki.grad, vi.grad])
    return outs


def test_cpu_core_attention_equals_megatron_local_attention():
    stock, ours = run_ranks(_attention_parity_on_rank, 1)[0]
    assert ours[0].shape == stock[0].shape == (7, 2, 32)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, stock):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


def test_pp2_log_probs_equal_pp1(forward_results):
    """1F1B over 2 stages (make_rows gives 2 micro-batches): only the last stage scores."""
    pp2 = forward_results["pp2"]
    assert sum(r["log_probs"] is not None for r in pp2) == 1
    torch.testing.assert_close(_last_stage(pp2), forward_results["tp1"]["log_probs"], atol=1e-5, rtol=0)


def test_combined_layouts_on_four_ranks_equal_one_rank(forward_results, tiny_model_path):
    """TP=2 x PP=2 and EP=2 x PP=2, each over 4 gloo ranks."""
    for tp, ep in ((2, 1), (1, 2)):
        results = run_ranks(_forward_on_rank, 4, tiny_model_path, tp, ep, 2)
        torch.testing.assert_close(
            _last_stage(results), forward_results["tp1"]["log_probs"], atol=1e-5, rtol=0, msg=f"tp={tp} ep={ep} pp=2"
        )


def test_cp2_with_tp2_and_pp2_on_four_ranks_equals_one_rank(forward_results, tiny_model_path):
    """CP=2 x TP=2 (sequence parallel: padded to a multiple of 2*cp*tp) and CP=2 x PP=2."""
    for tp, pp in ((2, 1), (1, 2)):
        results = run_ranks(_forward_on_rank, 4, tiny_model_path, tp, 1, pp, 2)
        torch.testing.assert_close(
            _last_stage(results), forward_results["tp1"]["log_probs"], atol=1e-5, rtol=0, msg=f"tp={tp} pp={pp} cp=2"
        )


def test_tp2_logits_equal_tp1(forward_results):
    tp1, tp2 = forward_results["tp1"], forward_results["tp2"]
    assert tp2["logits"].shape == tp1["logits"].shape
    torch.testing.assert_close(tp2["logits"], tp1["logits"], atol=1e-5, rtol=0)


def test_ep2_logits_equal_ep1(forward_results):
    tp1 = forward_results["tp1"]
    # EP=2 on 2 ranks is also DP=2 for the dense part: both ranks hold a full model copy.
    for rank_result in forward_results["ep2"]:
        torch.testing.assert_close(rank_result["logits"], tp1["logits"], atol=1e-5, rtol=0)


def test_mbridge_model_matches_hugging_face(forward_results, tiny_model_path):
    ref = hf_reference(tiny_model_path)
    mask = make_rows()["response_mask"]
    for name in ("tp1", "tp2"):
        got = forward_results[name]["log_probs"].double()
        assert got.shape == ref.shape
        torch.testing.assert_close(got * mask, ref * mask, atol=1e-5, rtol=0)
    assert ref.abs().sum() > 0  # the comparison is not vacuous


def test_mbridge_logits_equal_hugging_face_logits(forward_results, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ids = make_rows()["input_ids"]
    with torch.no_grad():
        ref = model(ids).logits  # causal: right padding does not touch the real positions
    for name in ("tp1", "tp2"):
        torch.testing.assert_close(forward_results[name]["logits"], ref, atol=1e-5, rtol=0)


def test_train_step_tp2_ep2_pp2_etp2_cp2_and_allgather_match_tp1(tiny_model_path, train_results):
    tp1 = train_results["tp1"]
    tp2 = run_ranks(_train_on_rank, 2, tiny_model_path, 2, 1)[0]
    ep2 = run_ranks(_train_on_rank, 2, tiny_model_path, 1, 2)[0]
    pp2 = run_ranks(_train_on_rank, 2, tiny_model_path, 1, 1, 2)[0]  # every stage exports the whole model
    # expert-TP: TP=2 with the experts split over 2 ranks too; EP=2 with the allgather dispatcher
    etp2 = run_ranks(_train_on_rank, 2, tiny_model_path, 2, 1, 1, 2)[0]
    allgather = run_ranks(_train_on_rank, 2, tiny_model_path, 1, 2, 1, 1, "allgather")[0]
    # context parallel: each token's loss counted once over the CP ranks (engine.loss_func)
    cp2 = run_ranks(_train_on_rank, 2, tiny_model_path, 1, 1, 1, 1, "alltoall", 2)[0]
    assert tp1["grad_norm"] > 0
    for other in (tp2, ep2, pp2, etp2, allgather, cp2, train_results["padded"], train_results["budget"]):
        assert other["grad_norm"] == pytest.approx(tp1["grad_norm"], rel=1e-5)
        assert set(other["weights"]) == set(tp1["weights"])
        for name, w in tp1["weights"].items():
            torch.testing.assert_close(other["weights"][name], w, atol=1e-6, rtol=0, msg=name)
    # the step changed the weights (so equality above is not just "nothing happened")
    from safetensors.torch import load_file

    before = load_file(str(tiny_model_path / "model.safetensors"))
    changed = sum(int(not torch.equal(before[k], tp1["weights"][k])) for k in before)
    assert changed > len(before) // 2


def _summed_loss_step(engine, rows) -> dict:
    """One optimizer step on `rows` with a summed (not averaged) policy loss, so the result does
    not depend on how rows are split over ranks: its grad norm and the exported weights."""
    from megarl.algo.losses import policy_loss

    def loss_fn(logp, ent, mb):
        mask = mb["response_mask"]
        loss, _ = policy_loss(logp, logp.detach(), mb["advantages"], mask, global_denominator=1.0)
        return loss, mask.sum(), {}

    metrics = engine.train_mini_batch(rows, loss_fn)
    return {"grad_norm": metrics["actor/grad_norm"], "weights": {k: v.clone() for k, v in engine.export_weights()}}


def _train_uneven_on_rank(rank, model_path, world):
    """Token-budget micro-batches with data-parallel ranks holding different rows: rank 0 needs 3
    micro-batches under the budget of 12 tokens, rank 1 only 2, so the count must be agreed (an
    EP all-to-all pairs the micro-batches up). One rank on all the rows is the reference."""
    from megarl.data.batch import Batch

    rows = make_rows()
    extra = rows[[0, 2, 3]]  # 8 + 4 + 9 tokens
    if world == 1:
        rows = Batch.concat([rows, extra])
    elif rank == 1:
        rows = extra
    engine = _engine(model_path, 1, world, train=True, max_tokens=12)
    return _summed_loss_step(engine, rows)


def test_token_budget_micro_batch_count_is_agreed_across_data_parallel_ranks(tiny_model_path):
    one = run_ranks(_train_uneven_on_rank, 1, tiny_model_path, 1)[0]
    two = run_ranks(_train_uneven_on_rank, 2, tiny_model_path, 2)[0]  # EP=2: DP=2 for the dense part
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, atol=1e-6, rtol=0, msg=name)


def _train_allgather_uneven_on_rank(rank, model_path, world, packed):
    """The allgather dispatcher with EP=2 when the data-parallel ranks' micro-batches differ in
    length (rank 0's longest packed micro-batch is 17 tokens, rank 1's 13): before the stream
    length was agreed across ranks, gloo aborted the rank ("Received data size doesn't match
    expected size"). One rank on both ranks' rows is the reference."""
    from megarl.data.batch import Batch

    rows = make_rows()  # 8, 9, 4 and 9 tokens
    other = rows[[2, 0, 2, 3]]
    if world == 1:
        rows = Batch.concat([rows, other])
    elif rank == 1:
        rows = other
    engine = _engine(model_path, 1, world, train=True, dispatcher="allgather", packed=packed)
    return _summed_loss_step(engine, rows)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_allgather_dispatcher_with_ranks_holding_different_lengths_equals_one_rank(tiny_model_path, packed):
    one = run_ranks(_train_allgather_uneven_on_rank, 1, tiny_model_path, 1, packed)[0]
    two = run_ranks(_train_allgather_uneven_on_rank, 2, tiny_model_path, 2, packed)[0]
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, atol=1e-6, rtol=0, msg=name)
