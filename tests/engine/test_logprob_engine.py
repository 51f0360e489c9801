"""The engine's chunked log-prob head inside Megatron, against Hugging Face in float64.

Log-probs, entropy and the gradient norm of a loss with an entropy term (what entropy_coeff != 0
trains) under TP=1 and TP=2 (vocab-parallel logits, gloo processes), with chunks of 3 tokens so
every micro-batch crosses several chunk boundaries. Tolerances as in test_megatron_engine.py:
1e-5 absolute on log-probs / entropy, 1e-5 relative on the gradient norm.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from tests.engine.test_megatron_engine import SEQ_ROWS, make_rows

ENTROPY_COEFF = 0.3


def hf_reference(model_path) -> dict:
    """Per-row response log-probs and entropy, and the loss's gradient norm, in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).double()
    rows = make_rows()
    lp = torch.zeros_like(rows["response_mask"], dtype=torch.float64)
    ent = torch.zeros_like(lp)
    total = torch.zeros((), dtype=torch.float64)
    for i, (p, r) in enumerate(SEQ_ROWS):
        logp = torch.log_softmax(model(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1], -1)
        row_lp = logp.gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1)
        row_ent = -(logp.exp() * logp).sum(-1)
        total = total + (_row_loss(row_lp, row_ent, rows["advantages"][i, : len(r)].double())).sum()
        lp[i, : len(r)], ent[i, : len(r)] = row_lp.detach(), row_ent.detach()
    (total / rows["response_mask"].sum()).backward()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))
    return {"log_probs": lp, "entropy": ent, "grad_norm": float(norm)}


def _row_loss(log_prob, entropy, advantages):
    return -advantages * log_prob - ENTROPY_COEFF * entropy


def _on_rank(rank, model_path, tp):
    from megarl.engine.megatron import logprob
    from tests.engine.test_megatron_engine import _engine

    logprob.CHUNK_BYTES = 3 * 4 * 64  # a few tokens a chunk (fp32 rows of the 64-token vocabulary)
    engine = _engine(model_path, tp, 1, train=True)
    rows = make_rows()
    out = engine.compute_log_prob(rows)
    ref_only = engine.compute_log_prob(rows, with_entropy=False)

    def loss_fn(lp, ent, mb):
        mask = mb["response_mask"]
        return (_row_loss(lp, ent, mb["advantages"]) * mask).sum(), mask.sum(), {}

    head = engine.logprob_head(1.0, entropy_grad=True)
    metrics = engine.train_mini_batch(rows, loss_fn, head=head)
    return {
        "log_probs": out["log_probs"],
        "entropy": out["entropy"],
        "keys_without_entropy": sorted(ref_only.keys()),
        "grad_norm": metrics["actor/grad_norm"],
    }


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return hf_reference(tiny_model_path)


@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_head_in_the_engine_equals_hugging_face_float64(tiny_model_path, reference, tp):
    got = run_ranks(_on_rank, tp, tiny_model_path, tp)[0]
    mask = make_rows()["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        assert (got[key].double() - reference[key])[mask].abs().max() <= 1e-5, key
    assert got["keys_without_entropy"] == ["log_probs"]
    assert reference["grad_norm"] > 0
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
