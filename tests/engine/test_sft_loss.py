"""The SFT objective on the Megatron engine (actor.sft_loss through train_mini_batch) against an
independent reference: the Hugging Face model in float64, cross entropy over the assistant tokens
only (labels -100 elsewhere), averaged over the batch's assistant tokens, and its gradient.

Rows are chat conversations rendered by the tiny tokenizer's template (data/sft.py), several with
more than one assistant turn (gaps in the loss mask). Layouts: one rank packed (THD) and padded,
and on two gloo ranks DP=2, TP=2 (sequence parallel), EP=2, CP=2 and PP=2 (1F1B), each with
micro-batches of 2 rows. Tolerances (fp32 engine vs float64): the loss to 1e-5 absolute and the gradient norm to
1e-5 relative (observed 1e-7 and at most 8e-8 in every layout); packed vs padded: loss and gradient norm
to 1e-6 relative and the weights after one Adam step to 1e-6 absolute (observed equal).
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks

CHATS = [
    [{"role": "user", "content": "what is 2+3?"}, {"role": "assistant", "content": "5"}],
    [
        {"role": "system", "content": "be brief."},
        {"role": "user", "content": "spell cat"},
        {"role": "assistant", "content": "c a t"},
        {"role": "user", "content": "again, with dashes"},
        {"role": "assistant", "content": "c-a-t"},
    ],
    [{"role": "user", "content": "12*3=?"}, {"role": "assistant", "content": "36, since 12*3 is 36."}],
    [
        {"role": "user", "content": "count to four"},
        {"role": "assistant", "content": "1, 2, 3, 4"},
        {"role": "user", "content": "and back?"},
        {"role": "assistant", "content": "4, 3, 2, 1."},
    ],
]


def conversations():
    """(ids, loss mask) of every chat, rendered and masked by data/sft.py."""
    from megarl.data.sft import tokenize_chat
    from megarl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    return [tokenize_chat(tok, chat) for chat in CHATS]


def hf_reference(model_path) -> tuple[float, float]:
    """(token-mean cross entropy over the assistant tokens, its gradient's global norm), float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).double()
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    for ids, mask in conversations():
        labels = torch.tensor([i if m else -100 for i, m in zip(ids, mask)])
        logits = model(torch.tensor([ids])).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
        tokens += int(sum(mask))
    loss = total / tokens
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss.detach()), float(norm)


def _sft_step_on_rank(rank, model_path, tp=1, ep=1, cp=1, pp=1, packed=True):
    from megarl.data.sft import engine_rows
    from megarl.engine.megatron.actor import ActorLossSpec, sft_loss
    from tests.engine.test_megatron_engine import _engine

    engine = _engine(
        model_path, tp, ep, train=True, pp=pp, cp=cp, packed=packed
    )  # Adam, no clipping, 2 rows a micro-batch
    rows = engine_rows(conversations())
    coord = engine.mesh_coord()
    mine = rows.chunk(coord["dp_size"])[coord["dp_rank"]]  # what DP_COMPUTE hands this rank
    spec = ActorLossSpec(objective="sft")
    metrics = engine.train_mini_batch(mine, lambda lp, ent, mb: sft_loss(spec, lp, ent, mb))
    weights = {k: v.clone() for k, v in engine.export_weights()}
    # the dp group's result, as DP_COMPUTE collects it: tp 0, cp 0, the last pipeline stage
    owner = coord["tp_rank"] == 0 and coord["cp_rank"] == 0 and coord["pp_rank"] == coord["pp_size"] - 1
    return {"metrics": metrics if owner else None, "weights": weights if rank == 0 else None}


def _step(model_path, world: int, **layout) -> dict:
    from megarl.trainer.sft import batch_loss
    from megarl.trainer.step_metrics import average

    results = run_ranks(_sft_step_on_rank, world, model_path, *(layout.get(k, d) for k, d in _DEFAULTS))
    metrics = average([r["metrics"] for r in results if r["metrics"] is not None])
    return {"loss": batch_loss(metrics), "grad_norm": metrics["actor/grad_norm"], "weights": results[0]["weights"]}


_DEFAULTS = (("tp", 1), ("ep", 1), ("cp", 1), ("pp", 1), ("packed", True))


@pytest.fixture(scope="module")
def steps(tiny_model_path):
    return {
        "packed": _step(tiny_model_path, 1),
        "padded": _step(tiny_model_path, 1, packed=False),
        "dp2": _step(tiny_model_path, 2),
        "tp2": _step(tiny_model_path, 2, tp=2),
        "ep2": _step(tiny_model_path, 2, ep=2),
        "cp2": _step(tiny_model_path, 2, cp=2),
        "pp2": _step(tiny_model_path, 2, pp=2),
    }


def test_sft_loss_and_gradient_equal_hugging_face_float64_in_every_layout(steps, tiny_model_path):
    loss, norm = hf_reference(tiny_model_path)
    assert 1.0 < loss < 10.0 and norm > 0  # a random model's loss on real tokens: the check is not vacuous
    for name, got in steps.items():
        assert got["loss"] == pytest.approx(loss, abs=1e-5), name
        assert got["grad_norm"] == pytest.approx(norm, rel=1e-5), name


def test_packed_and_padded_rows_give_the_same_loss_gradient_and_step(steps):
    packed, padded = steps["packed"], steps["padded"]
    assert padded["loss"] == pytest.approx(packed["loss"], rel=1e-6)
    assert padded["grad_norm"] == pytest.approx(packed["grad_norm"], rel=1e-6)
    for name, w in packed["weights"].items():
        torch.testing.assert_close(padded["weights"][name], w, atol=1e-6, rtol=0, msg=name)
