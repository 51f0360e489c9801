"""The fused log-prob head's two ways to have each chunk's logits in backward: kept from forward
(keep_logits, actor.logits_memory=keep) or made again (recompute).

Keeping is the same GEMM on the same chunk, written into a [tokens, vocab] tensor instead of a
reused buffer, so both modes give the same bits: log-prob, entropy, d hidden and d weight are
compared with torch.equal on CPU. What keeping saves is counted, not timed: wrappers of torch.mm
and torch.empty record every logits GEMM (hidden [rows, h] @ weight^T) and every [tokens, vocab] allocation, so
a backward that makes the logits again, or a no-grad pass that keeps them, fails here.
"""

from __future__ import annotations

import pytest
import torch

from megarl.engine.megatron.logprob import KEEP_LOGITS_BYTES, fused_linear_logprob_entropy, keeps_logits

N, H, V, CHUNK = 23, 16, 97, 4  # 23 tokens in chunks of 4: six chunks, none of them the whole


def _inputs(dtype=torch.float32, seed=3):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.8).to(dtype)
    labels = torch.randint(0, V, (N,), generator=gen)
    w_lp, w_ent = torch.randn(N, generator=gen, dtype=torch.float64), torch.randn(N, generator=gen, dtype=torch.float64)
    return hidden, weight, labels, w_lp, w_ent


class _Calls:
    """Counts logits GEMMs (an [rows, H] @ [H, V] product) and allocations of [N, V] or more while
    it is entered, by wrapping torch.mm and torch.empty (a TorchFunctionMode does not reach a
    custom Function's backward, which the autograd engine runs)."""

    def __init__(self):
        self.logits_gemms = 0
        self.whole_allocs = 0

    def __enter__(self):
        self._mm, self._empty = torch.mm, torch.empty

        def mm(a, b, **kw):
            self.logits_gemms += b.shape == (H, V)
            return self._mm(a, b, **kw)

        def empty(*size, **kw):
            shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
            self.whole_allocs += torch.Size(shape).numel() >= N * V
            return self._empty(*size, **kw)

        torch.mm, torch.empty = mm, empty
        return self

    def __exit__(self, *exc):
        torch.mm, torch.empty = self._mm, self._empty


def _run(keep, dtype=torch.float32, temperature=1.0, entropy_grad=True):
    hidden, weight, labels, w_lp, w_ent = _inputs(dtype)
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    forward, backward = _Calls(), _Calls()
    with forward:
        lp, ent = fused_linear_logprob_entropy(
            h, w, labels, keep_logits=keep, temperature=temperature, chunk=CHUNK, entropy_grad=entropy_grad
        )
    loss = (lp.double() * w_lp).sum() + ((ent.double() * w_ent).sum() if entropy_grad else 0)
    with backward:
        loss.backward()
    return (lp.detach(), ent.detach(), h.grad, w.grad), forward, backward


@pytest.mark.parametrize(
    "dtype, temperature, entropy_grad",
    [(torch.float32, 1.0, True), (torch.float32, 0.7, True), (torch.float32, 1.0, False), (torch.bfloat16, 0.7, True)],
)
def test_kept_logits_give_the_bits_recompute_gives(dtype, temperature, entropy_grad):
    kept, _, _ = _run(True, dtype, temperature, entropy_grad)
    made, _, _ = _run(False, dtype, temperature, entropy_grad)
    for a, b, name in zip(kept, made, ("log_prob", "entropy", "d_hidden", "d_weight")):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_keep_runs_the_logits_gemm_once_per_chunk_and_recompute_twice():
    chunks = -(-N // CHUNK)
    _, fwd, bwd = _run(True)
    assert (fwd.logits_gemms, bwd.logits_gemms) == (chunks, 0)  # backward reads the kept logits
    assert fwd.whole_allocs == 1 and bwd.whole_allocs == 0  # the one kept [N, V] tensor
    _, fwd, bwd = _run(False)
    assert (fwd.logits_gemms, bwd.logits_gemms) == (chunks, chunks)
    assert fwd.whole_allocs == bwd.whole_allocs == 0


def test_a_pass_without_gradients_keeps_nothing():
    hidden, weight, labels, _, _ = _inputs()
    for grad_mode, requires_grad in ((False, True), (True, False)):  # compute_log_prob; frozen inputs
        h, w = hidden.clone().requires_grad_(requires_grad), weight.clone().requires_grad_(requires_grad)
        calls = _Calls()
        with torch.set_grad_enabled(grad_mode), calls:
            lp, _ = fused_linear_logprob_entropy(h, w, labels, keep_logits=True, chunk=CHUNK)
        assert calls.whole_allocs == 0 and lp.grad_fn is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_second_backward_through_kept_logits_is_refused(dtype):
    """Backward works in the kept rows once it has read them: a retained graph's second backward
    would read d/d logits as logits, and autograd's version check refuses it instead."""
    hidden, weight, labels, _, _ = _inputs(dtype)
    lp, _ = fused_linear_logprob_entropy(hidden.requires_grad_(True), weight, labels, keep_logits=True, chunk=CHUNK)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()


def test_auto_keeps_the_logits_while_they_fit_the_budget():
    tokens = KEEP_LOGITS_BYTES // (2 * 151936)  # bf16 logits of a 152k vocabulary at the budget
    assert keeps_logits("auto", tokens, 151936, torch.bfloat16)
    assert not keeps_logits("auto", tokens + 1, 151936, torch.bfloat16)
    assert not keeps_logits("auto", 8192, 151936, torch.float32)  # the benchmark's default: 4.6 GiB
    assert keeps_logits("auto", 8192, 151936 // 8, torch.bfloat16)  # TP=8
    assert keeps_logits("keep", 10**9, 151936, torch.float32)
    assert not keeps_logits("recompute", 1, 64, torch.float32)
    with pytest.raises(ValueError, match="logits_memory='kept': must be one of auto, keep, recompute"):
        keeps_logits("kept", 1, 64, torch.float32)


def test_actor_logits_memory_reaches_the_engine_spec():
    from megarl.config.loader import ConfigError, load_config
    from megarl.trainer.runtime import engine_spec

    assert engine_spec(load_config(None, []), "m").logits_memory == "auto"
    assert engine_spec(load_config(None, ["actor.logits_memory=recompute"]), "m").logits_memory == "recompute"
    with pytest.raises(ConfigError, match=r"actor\.logits_memory.*must be one of"):
        load_config(None, ["actor.logits_memory=always"])
