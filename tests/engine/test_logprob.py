"""The chunked vocab-parallel log-prob / entropy head against an independent reference.

References: torch's own log_softmax over the whole vocabulary with autograd, in fp32 (the unchunked
computation) and in float64. Tolerances: 1e-6 absolute against fp32 (observed ~5e-7 at
most), 1e-5 against float64 for values and 1e-6 for gradients (the float64 gradient
entries are O(1/V)). Chunk sizes that do not divide the token count catch an off-by-one
chunk boundary; TP=2 runs as two gloo processes, each holding half of the vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from megarl.engine.megatron.logprob import (
    CHUNK_BYTES,
    chunk_tokens,
    fused_linear_logprob_entropy,
    vocab_parallel_logprob_entropy,
)
from tests._dist import run_ranks

N, V = 23, 97  # tokens (a prime: no chunk size below divides it) and vocabulary


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=gen, dtype=torch.float64) * 3).to(dtype)
    labels = torch.randint(0, V, (N,), generator=gen)
    w_lp = torch.randn(N, generator=gen, dtype=torch.float64)
    w_ent = torch.randn(N, generator=gen, dtype=torch.float64)
    return logits, labels, w_lp, w_ent


def _reference(logits, labels, w_lp, w_ent, temperature, dtype):
    """(log_prob, entropy, d loss / d logits) of the unchunked computation in `dtype`."""
    x = logits.detach().to(dtype).requires_grad_(True)
    logp = torch.log_softmax(x / temperature, dim=-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * w_lp.to(dtype)).sum() + (ent * w_ent.to(dtype)).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


def _close(got, ref, tol) -> bool:
    """|got - ref| <= tol * max(1, |ref|) everywhere: absolute for the O(1/V) probabilities,
    relative for the O(1) entries (the label's gradient, log-probs of unlikely tokens)."""
    return bool(((got - ref).abs() <= tol * ref.abs().clamp(min=1)).all())


def _chunked(logits, labels, w_lp, w_ent, temperature, chunk, **kw):
    x = logits.detach().clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprob_entropy(x, labels, temperature=temperature, chunk=chunk, **kw)
    loss = (lp.double() * w_lp).sum() + ((ent.double() * w_ent).sum() if ent is not None and ent.requires_grad else 0)
    loss.backward()
    return lp.detach(), None if ent is None else ent.detach(), x.grad


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 7, N, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_unchunked_and_float64(chunk, temperature, overwrite):
    logits, labels, w_lp, w_ent = _inputs()
    lp, ent, grad = _chunked(logits, labels, w_lp, w_ent, temperature, chunk, overwrite_logits=overwrite)
    ref32 = _reference(logits, labels, w_lp, w_ent, temperature, torch.float32)
    ref64 = _reference(logits, labels, w_lp, w_ent, temperature, torch.float64)
    for got, r32, r64, name in zip((lp, ent, grad), ref32, ref64, ("log_prob", "entropy", "grad")):
        assert got.dtype == torch.float32, name
        assert _close(got, r32, 1e-6), name
        assert _close(got.double(), r64, 1e-6 if name == "grad" else 1e-5), name


def test_entropy_as_metric_or_absent_leaves_the_log_prob_gradient():
    logits, labels, w_lp, w_ent = _inputs(seed=1)
    ref = _reference(logits, labels, w_lp, torch.zeros_like(w_ent), 1.0, torch.float64)
    metric = _chunked(logits, labels, w_lp, w_ent, 1.0, 5, entropy_grad=False)
    absent = _chunked(logits, labels, w_lp, w_ent, 1.0, 5, with_entropy=False)
    assert absent[1] is None
    assert (metric[1].double() - ref[1]).abs().max() <= 1e-5  # the metric's value is still right
    for got in (metric, absent):
        assert (got[0].double() - ref[0]).abs().max() <= 1e-5
        assert _close(got[2].double(), ref[2], 1e-6)


def test_batched_bf16_logits_give_an_fp32_result_and_a_bf16_gradient():
    logits, labels, w_lp, w_ent = _inputs(torch.bfloat16, seed=2)
    shaped = logits.reshape(1, N, V)
    x = shaped.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprob_entropy(x, labels.reshape(1, N), chunk=6)
    assert lp.shape == ent.shape == (1, N) and lp.dtype == torch.float32
    ((lp.double() * w_lp).sum() + (ent.double() * w_ent).sum()).backward()
    ref = _reference(logits.float(), labels, w_lp, w_ent, 1.0, torch.float64)  # the bf16 values, exactly
    assert (lp[0].double() - ref[0]).abs().max() <= 1e-5
    assert x.grad.dtype == torch.bfloat16
    assert (x.grad[0].double() - ref[2]).abs().max() <= 1e-2  # bf16 rounding of O(1) entries


def test_default_chunk_bounds_the_intermediates():
    assert chunk_tokens(151936) * 151936 * 4 <= CHUNK_BYTES < (chunk_tokens(151936) + 1) * 151936 * 4
    assert chunk_tokens(10**9) == 1


def _tp_rank(rank, chunk, temperature, entropy_grad):
    import torch.distributed as dist

    logits, labels, w_lp, w_ent = _inputs(seed=3)
    half = V // 2  # V is odd: rank 1's slice is one wider, which the head does not assume away
    local = logits[:, :half] if rank == 0 else logits[:, half:]
    x = local.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprob_entropy(
        x,
        labels,
        rank * half,
        dist.group.WORLD,
        temperature,
        entropy_grad=entropy_grad,
        chunk=chunk,
        overwrite_logits=True,  # as the engine runs it
    )
    loss = (lp.double() * w_lp).sum() + ((ent.double() * w_ent).sum() if entropy_grad else 0)
    loss.backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("chunk,temperature,entropy_grad", [(5, 1.0, True), (1, 0.7, True), (64, 1.0, False)])
def test_tp2_over_gloo_equals_one_rank_float64(chunk, temperature, entropy_grad):
    logits, labels, w_lp, w_ent = _inputs(seed=3)
    ref = _reference(
        logits, labels, w_lp, w_ent if entropy_grad else torch.zeros_like(w_ent), temperature, torch.float64
    )
    ranks = run_ranks(_tp_rank, 2, chunk, temperature, entropy_grad)
    for lp, ent, _ in ranks:  # both ranks hold the reduced values
        assert (lp.double() - ref[0]).abs().max() <= 1e-5
        assert (ent.double() - ref[1]).abs().max() <= 1e-5
    grad = torch.cat([ranks[0][2], ranks[1][2]], dim=-1)  # each rank's slice of d/d logits
    assert _close(grad.double(), ref[2], 1e-6)


def test_overwrite_puts_the_gradient_in_the_logits_storage():
    """What saves the engine a [tokens, vocab] buffer in backward (the bench measures it)."""
    logits, labels, w_lp, w_ent = _inputs(seed=4)
    x = logits.clone().requires_grad_(True)
    lp, _ = vocab_parallel_logprob_entropy(x, labels, chunk=5, overwrite_logits=True)
    (lp.double() * w_lp).sum().backward()
    assert x.grad.data_ptr() == x.data_ptr()
    ref = _reference(logits, labels, w_lp, torch.zeros_like(w_ent), 1.0, torch.float64)
    assert _close(x.grad.double(), ref[2], 1e-6)


# ---------------------------------------------------------------- the output layer fused in
# Tolerances relative to the tensor's largest entry (normwise, as a GEMM's error bound is): the
# fp32 full computation is itself 1e-7..7e-7 from float64 on these inputs, so elementwise 1e-6
# against it would test its rounding, not ours. Observed fused vs fp32 full: <= 8.4e-7.
H = 16  # hidden size


def _close_norm(got, ref, tol) -> bool:
    return float((got.double() - ref.double()).abs().max()) <= tol * max(1.0, float(ref.double().abs().max()))


def _linear_inputs(dtype=torch.float32, seed=5):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.8).to(dtype)
    _, labels, w_lp, w_ent = _inputs(seed=seed)
    return hidden, weight, labels, w_lp, w_ent


def _linear_reference(hidden, weight, labels, w_lp, w_ent, temperature, dtype):
    """The full computation: logits = hidden @ weight^T, then log_softmax over the whole vocabulary."""
    h, w = (t.detach().to(dtype).requires_grad_(True) for t in (hidden, weight))
    logp = torch.log_softmax((h @ w.t()) / temperature, dim=-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * w_lp.to(dtype)).sum() + (ent * w_ent.to(dtype)).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _fused(hidden, weight, labels, w_lp, w_ent, temperature, chunk, **kw):
    h, w = (t.detach().clone().requires_grad_(True) for t in (hidden, weight))
    lp, ent = fused_linear_logprob_entropy(h, w, labels, temperature=temperature, chunk=chunk, **kw)
    loss = (lp.double() * w_lp).sum() + ((ent.double() * w_ent).sum() if ent is not None and ent.requires_grad else 0)
    loss.backward()
    return lp.detach(), None if ent is None else ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 4, 7, N, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_output_layer_equals_logits_then_full_softmax(chunk, temperature):
    args = _linear_inputs()
    got = _fused(*args, temperature, chunk)
    ref32 = _linear_reference(*args, temperature, torch.float32)
    ref64 = _linear_reference(*args, temperature, torch.float64)
    for g, r32, r64, name in zip(got, ref32, ref64, ("log_prob", "entropy", "d_hidden", "d_weight")):
        assert g.dtype == torch.float32, name
        assert _close_norm(g, r32, 1e-6), name
        assert _close_norm(g, r64, 1e-5), name


def test_fused_entropy_as_metric_or_absent_leaves_the_log_prob_gradient():
    hidden, weight, labels, w_lp, w_ent = _linear_inputs(seed=6)
    ref = _linear_reference(hidden, weight, labels, w_lp, torch.zeros_like(w_ent), 1.0, torch.float64)
    metric = _fused(hidden, weight, labels, w_lp, w_ent, 1.0, 5, entropy_grad=False)
    absent = _fused(hidden, weight, labels, w_lp, w_ent, 1.0, 5, with_entropy=False)
    assert absent[1] is None
    assert (metric[1].double() - ref[1]).abs().max() <= 1e-5
    for got in (metric, absent):
        for g, r in zip(got[2:], ref[2:]):
            assert _close_norm(g, r, 1e-5)


def test_fused_bf16_makes_bf16_logits_then_fp32_and_bf16_gradients():
    """The model's precision: a bf16 GEMM per chunk, as the output layer made the logits."""
    hidden, weight, labels, w_lp, w_ent = _linear_inputs(torch.bfloat16, seed=7)
    lp, ent, d_hidden, d_weight = _fused(hidden, weight, labels, w_lp, w_ent, 1.0, 6)
    logits = (hidden @ weight.t()).float()  # bf16 logits, exactly as the unfused model had them
    ref = _reference(logits, labels, w_lp, w_ent, 1.0, torch.float64)
    assert lp.dtype == ent.dtype == torch.float32
    assert (lp.double() - ref[0]).abs().max() <= 1e-5 and (ent.double() - ref[1]).abs().max() <= 1e-5
    assert d_hidden.dtype == d_weight.dtype == torch.bfloat16
    ref_dh, ref_dw = ref[2] @ weight.double(), ref[2].t() @ hidden.double()
    assert _close_norm(d_hidden, ref_dh, 1e-2) and _close_norm(d_weight, ref_dw, 1e-2)  # bf16 rounding


def test_fused_frozen_weight_gets_no_gradient():
    hidden, weight, labels, w_lp, _ = _linear_inputs(seed=8)
    h = hidden.clone().requires_grad_(True)
    lp, _ = fused_linear_logprob_entropy(h, weight, labels, chunk=4, with_entropy=False)
    (lp.double() * w_lp).sum().backward()
    ref = _linear_reference(hidden, weight, labels, w_lp, torch.zeros(N), 1.0, torch.float64)
    assert weight.grad is None and _close_norm(h.grad, ref[2], 1e-5)


def _fused_tp_rank(rank, chunk, temperature):
    import torch.distributed as dist

    hidden, weight, labels, w_lp, w_ent = _linear_inputs(seed=9)
    half = V // 2  # rank 1's slice is one wider
    w = (weight[:half] if rank == 0 else weight[half:]).clone().requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    lp, ent = fused_linear_logprob_entropy(
        h, w, labels, vocab_start=rank * half, group=dist.group.WORLD, temperature=temperature, chunk=chunk
    )
    ((lp.double() * w_lp).sum() + (ent.double() * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk,temperature", [(5, 1.0), (1, 0.7)])
def test_fused_tp2_over_gloo_equals_the_full_computation(chunk, temperature):
    args = _linear_inputs(seed=9)
    ref = _linear_reference(*args, temperature, torch.float32)
    ranks = run_ranks(_fused_tp_rank, 2, chunk, temperature)
    for lp, ent, _, _ in ranks:
        assert _close_norm(lp, ref[0], 1e-6) and _close_norm(ent, ref[1], 1e-6)
    d_hidden = ranks[0][2] + ranks[1][2]  # each rank's vocabulary's share: the output layer's all-reduce
    assert _close_norm(d_hidden, ref[2], 1e-6)
    assert _close_norm(torch.cat([ranks[0][3], ranks[1][3]]), ref[3], 1e-6)
