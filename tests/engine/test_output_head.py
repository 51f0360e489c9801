"""The policy head on a real Megatron output layer against the full computation.

PolicyHead's output_processor takes what GPTModel hands it (the final hidden states, this rank's
part of the sequence under sequence parallel; its ColumnParallelLinear output layer; the shared
embedding weight when tied) and the head turns it into log-probs and entropy without logits.
Here a ColumnParallelLinear over TP=1 and TP=2 gloo ranks, sequence parallel off and on, with
its own weight and with a tied one passed as `output_weight`, temperature 0.7 and chunks of 3
tokens, the logits kept for backward and made again (actor.logits_memory: the same bits). Reference: one process, plain torch in fp32: logits = hidden @ W^T over the whole
vocabulary, log_softmax, autograd. Tolerance 1e-6 relative to each tensor's largest entry
(normwise, as in test_logprob.py); d hidden is compared where the output layer's own backward
leaves it: each rank's sequence slice (SP) or the all-reduced whole (no SP).
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks

S, B, HID, VOCAB, TEMPERATURE = 6, 2, 16, 50, 0.7
CASES = {1: [(False, False), (False, True)], 2: [(False, False), (True, False), (False, True), (True, True)]}


def _inputs():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(S, B, HID, generator=gen)
    weight = torch.randn(VOCAB, HID, generator=gen) * 0.75
    labels = torch.randint(0, VOCAB, (B, S), generator=gen)
    w_lp, w_ent = torch.randn(B, S, generator=gen), torch.randn(B, S, generator=gen)
    return hidden, weight, labels, w_lp, w_ent


def _reference():
    """(log_prob [B, S], entropy [B, S], d hidden [S, B, HID], d weight) of the full computation."""
    hidden, weight, labels, w_lp, w_ent = _inputs()
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    logp = torch.log_softmax((h @ w.t()).transpose(0, 1) / TEMPERATURE, dim=-1)  # [B, S, V]
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _on_rank(rank, tp):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.engine.megatron import logprob
    from megarl.engine.megatron.cpu import compat as cpu_compat
    from megarl.engine.megatron.output_head import PolicyHead

    cpu_compat.activate()
    ps.initialize_model_parallel(tp, 1)
    logprob.CHUNK_BYTES = 3 * 4 * (VOCAB // tp)  # 3 tokens a chunk
    hidden, weight, labels, w_lp, w_ent = _inputs()
    shard = weight.chunk(tp)[rank]
    results = []
    for (sp, tied), logits_memory in [(case, mode) for case in CASES[tp] for mode in ("keep", "recompute")]:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HID,
            num_attention_heads=2,
            use_cpu_initialization=True,
            tensor_model_parallel_size=tp,
            sequence_parallel=sp,
        )
        layer = ColumnParallelLinear(
            HID,
            VOCAB,
            config=config,
            init_method=torch.nn.init.zeros_,
            bias=False,
            gather_output=False,
            skip_weight_param_allocation=tied,
        )
        w = torch.nn.Parameter(shard.clone()) if tied else layer.weight  # tied: the embedding's weight
        if not tied:
            with torch.no_grad():
                w.copy_(shard)
        x = (hidden.chunk(tp)[rank] if sp else hidden).clone().requires_grad_(True)
        head = PolicyHead(TEMPERATURE, logits_memory=logits_memory)
        out = head.output_processor(
            hidden_states=x, output_layer=layer, output_weight=w if tied else None, config=config, labels=None
        )
        lp, ent = head(out, labels)
        ((lp.double() * w_lp).sum() + (ent.double() * w_ent).sum()).backward()
        results.append((lp.detach(), ent.detach(), x.grad, w.grad, layer.weight is None or layer.weight.grad is None))
    return results


def _close_norm(got, ref, tol=1e-6) -> bool:
    return float((got.double() - ref.double()).abs().max()) <= tol * max(1.0, float(ref.double().abs().max()))


@pytest.mark.parametrize("tp", [1, 2])
def test_policy_head_on_megatron_output_layer_equals_full_computation(tp):
    ref_lp, ref_ent, ref_dh, ref_dw = _reference()
    ranks = run_ranks(_on_rank, tp, tp)
    for i, (sp, tied) in enumerate(CASES[tp]):
        case = f"tp={tp} sp={sp} tied={tied}"
        for rank, results in enumerate(ranks):
            kept, made = results[2 * i], results[2 * i + 1]
            assert all(torch.equal(a, b) for a, b in zip(kept[:4], made[:4])), case
            lp, ent, dh, dw, own_weight_untouched = kept
            assert _close_norm(lp, ref_lp) and _close_norm(ent, ref_ent), case
            assert _close_norm(dh, ref_dh.chunk(tp)[rank] if sp else ref_dh), case
            assert _close_norm(dw, ref_dw.chunk(tp)[rank]), case
            if tied:  # the gradient went to the weight GPTModel passed, not to an output layer's own
                assert own_weight_untouched, case
