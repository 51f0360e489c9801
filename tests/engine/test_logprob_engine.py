"""The engine's policy head inside Megatron (the output layer fused into the chunked log-prob
head, output_head.py), against Hugging Face in float64.

Log-probs, entropy and the gradient norm of a loss with an entropy term (what entropy_coeff != 0
trains) under TP=1 and TP=2 (vocab-parallel output layer, gloo processes, sequence parallel on),
on a model with tied embeddings (TP=2, sequence parallel off: the output weight is the shared
embedding's), and through the actor's own update (MegatronActor.update_actor with
actor.entropy_coeff != 0, whose head must then carry the entropy's gradient). Chunks of 3
tokens, so every micro-batch crosses several chunk boundaries. Tolerances as in
test_megatron_engine.py: 1e-5 absolute on log-probs / entropy, 1e-5 relative on the gradient norm.
"""

from __future__ import annotations

import pytest
import torch

from megarl.procs.net import free_port
from tests._dist import run_ranks
from tests.engine.test_megatron_engine import SEQ_ROWS, make_rows

ENTROPY_COEFF = 0.3
CHUNK_BYTES = 3 * 4 * 64  # a few tokens a chunk (fp32 rows of the 64-token vocabulary)


def hf_reference(model_path, entropy_coeff=ENTROPY_COEFF) -> dict:
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
        total = total + (-rows["advantages"][i, : len(r)].double() * row_lp - entropy_coeff * row_ent).sum()
        lp[i, : len(r)], ent[i, : len(r)] = row_lp.detach(), row_ent.detach()
    (total / rows["response_mask"].sum()).backward()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))
    return {"log_probs": lp, "entropy": ent, "grad_norm": float(norm)}


def _spec(model_path, tp, sequence_parallel):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec

    return EngineSpec(
        model_path=str(model_path),
        parallel=ParallelConfig(tp=tp, sequence_parallel=sequence_parallel),
        optim=OptimConfig(lr=1e-3, adam_eps=1e-2, clip_grad=0.0),
        micro_batch_size=2,
        seed=1,
    )


def _on_rank(rank, model_path, tp, sequence_parallel):
    from megarl.engine.megatron import logprob
    from megarl.engine.megatron.engine import MegatronEngine

    logprob.CHUNK_BYTES = CHUNK_BYTES
    engine = MegatronEngine(_spec(model_path, tp, sequence_parallel))
    engine.initialize()
    rows = make_rows()
    out = engine.compute_log_prob(rows)
    ref_only = engine.compute_log_prob(rows, with_entropy=False)

    def loss_fn(lp, ent, mb):
        mask = mb["response_mask"]
        return ((-mb["advantages"] * lp - ENTROPY_COEFF * ent) * mask).sum(), mask.sum(), {}

    metrics = engine.train_mini_batch(rows, loss_fn, head=engine.logprob_head(1.0, entropy_grad=True))
    return {
        "log_probs": out["log_probs"],
        "entropy": out["entropy"],
        "keys_without_entropy": sorted(ref_only.keys()),
        "grad_norm": metrics["actor/grad_norm"],
    }


def _actor_on_rank(rank, model_path, port):
    """update_actor with entropy_coeff != 0, old log-probs the policy's own (ratio 1: the loss's
    gradient is -A d log p - coeff d H, token-mean, as hf_reference's)."""
    import torch.distributed as dist

    from megarl.engine.megatron import logprob
    from megarl.engine.megatron.actor import ActorLossSpec, MegatronActor

    logprob.CHUNK_BYTES = CHUNK_BYTES
    dist.destroy_process_group()  # the worker joins its own group, as under Ray
    actor = MegatronActor(
        _spec(model_path, 1, False),
        ActorLossSpec(entropy_coeff=ENTROPY_COEFF),
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=port,
    )
    actor.init_distributed()
    rows = make_rows()
    old = actor.compute_log_prob(rows)
    return actor.update_actor(rows.union(old.select("old_log_probs")), mini_batch_size=len(rows))


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return hf_reference(tiny_model_path)


@pytest.fixture(scope="module")
def tied_model_path(tmp_path_factory):
    from megarl.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("tied") / "tiny-qwen3-tied", preset="tiny-qwen3", tie_word_embeddings=True
    )


def _check(got, reference):
    mask = make_rows()["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        assert (got[key].double() - reference[key])[mask].abs().max() <= 1e-5, key
    assert got["keys_without_entropy"] == ["log_probs"]
    assert reference["grad_norm"] > 0
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_policy_head_in_the_engine_equals_hugging_face_float64(tiny_model_path, reference, tp):
    _check(run_ranks(_on_rank, tp, tiny_model_path, tp, tp > 1)[0], reference)


def test_tied_embeddings_tp2_without_sequence_parallel(tied_model_path):
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tied_model_path).tie_word_embeddings
    _check(run_ranks(_on_rank, 2, tied_model_path, 2, False)[0], hf_reference(tied_model_path))


def test_actor_update_with_entropy_coeff_trains_the_entropy(tiny_model_path, reference):
    metrics = run_ranks(_actor_on_rank, 1, tiny_model_path, free_port())[0]
    without = hf_reference(tiny_model_path, entropy_coeff=0.0)["grad_norm"]
    assert abs(without - reference["grad_norm"]) > 1e-3 * reference["grad_norm"]  # the entropy term counts
    assert metrics["actor/grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
