"""THD packing and token balancing: pure functions, checked against direct computations.

Attention tolerance: fp32, 1e-6 absolute against a per-sequence float64 reference.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from megarl.data.balance import balance_across_ranks, min_micro_batches, partition_micro_batches
from megarl.engine.megatron.packing import pack_rows, padded_row_lengths, row_lengths


def test_pack_rows_puts_rows_back_to_back_with_their_own_positions_and_labels():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    lengths = row_lengths(ids, torch.tensor([2, 1, 2]), torch.tensor([[1, 0], [1, 0], [1, 1]]))
    assert lengths.tolist() == [3, 2, 4]
    packed = pack_rows(ids, lengths, padded_row_lengths(lengths, row_multiple=2))
    # rows padded to 4, 2, 4 tokens: the padding of a row sits right after it
    assert packed.input_ids.tolist() == [[5, 6, 7, 0, 8, 9, 1, 2, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]]
    # a row's last real token has no label: never the next row's first token
    assert packed.labels.tolist() == [[6, 7, 0, 0, 9, 0, 2, 3, 4, 0]]
    assert packed.cu_seqlens.tolist() == [0, 4, 6, 10] and packed.offsets.tolist() == [0, 4, 6]
    assert packed.max_seqlen == 4
    assert packed.padding_mask.tolist() == [[False, False, False, True, False, False, False, False, False, False]]


def test_padded_row_lengths_meet_the_cp_and_sp_multiples():
    lengths = torch.tensor([3, 5, 1])
    padded = padded_row_lengths(lengths, row_multiple=4, total_multiple=3)
    assert (padded % 4 == 0).all() and int(padded.sum()) % 3 == 0 and (padded >= lengths).all()
    assert padded.tolist() == [4, 8, 12]  # 16 -> 24 (lcm 12): the last row takes the extra 8
    assert padded_row_lengths(lengths, 1, 1, total=20).tolist() == [3, 5, 12]
    with pytest.raises(ValueError, match="cannot pad a stream of 9 tokens to 8"):
        padded_row_lengths(lengths, 1, 1, total=8)


def test_row_lengths_refuse_rows_longer_than_input_ids():
    with pytest.raises(ValueError, match="prompt_lengths / response_mask disagree"):
        row_lengths(torch.zeros(1, 3, dtype=torch.long), torch.tensor([3]), torch.ones(1, 2))


def test_token_budget_micro_batches_fit_and_balance():
    rng = random.Random(0)
    # long tail: log-normal lengths, max 8x the median
    lengths = [min(int(rng.lognormvariate(math.log(40), 0.8)) + 1, 320) for _ in range(64)]
    budget = 512
    k = min_micro_batches(lengths, budget)
    parts = partition_micro_batches(lengths, k)
    assert sorted(i for p in parts for i in p) == list(range(64))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) <= budget
    assert k <= math.ceil(sum(lengths) / budget) + 1  # near the lower bound (sum / budget)
    assert max(loads) - min(loads) <= max(lengths)  # LPT: loads differ by at most one row


def test_a_row_longer_than_the_budget_goes_alone():
    assert min_micro_batches([50, 3, 3], 10) == 2
    assert partition_micro_batches([50, 3, 3], 2) == [[0], [1, 2]]
    with pytest.raises(ValueError, match="cannot split 3 rows into 4"):
        partition_micro_batches([1, 2, 3], 4)


def test_balance_across_ranks_keeps_chunk_sizes_and_evens_tokens():
    lengths = [100, 1, 1, 1, 90, 1, 80, 2, 3]
    order = balance_across_ranks(lengths, 2)
    assert sorted(order) == list(range(9))
    first, second = order[:5], order[5:]  # Batch.chunk(2) sizes: 5, 4
    naive = abs(sum(lengths[:5]) - sum(lengths[5:]))
    balanced = abs(sum(lengths[i] for i in first) - sum(lengths[i] for i in second))
    assert balanced < naive and balanced <= max(lengths)


def test_a_near_even_batch_keeps_its_order():
    # chunk(2) loads 12 and 11: balancing could gain one token, not worth reshuffling mini-batches
    assert balance_across_ranks([3, 3, 3, 3, 3, 3, 3, 2], 2) == list(range(8))


def _reference_attention(q, k, v, cu, scale):
    """Each sequence alone, dense causal softmax in float64: [t, h, d] x3 -> [t, h * dv]."""
    outs = []
    for s, e in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (x[s:e].double().transpose(0, 1) for x in (q, k, v))
        ks = ks.repeat_interleave(qs.shape[0] // ks.shape[0], 0)
        vs = vs.repeat_interleave(qs.shape[0] // vs.shape[0], 0)
        scores = qs @ ks.transpose(1, 2) * scale
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append((probs @ vs).transpose(0, 1).reshape(e - s, -1))
    return torch.cat(outs)


def test_cpu_core_attention_thd_equals_each_sequence_alone():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.engine.megatron.cpu.attention import CpuCoreAttention

    config = SimpleNamespace(kv_channels=8, attention_dropout=0.0, context_parallel_size=1)
    attn = CpuCoreAttention(config, 1, AttnMaskType.causal, None).eval()
    torch.manual_seed(0)
    cu = [0, 5, 6, 13]
    q, k = torch.randn(13, 4, 8), torch.randn(13, 2, 8)
    v = torch.randn(13, 2, 12)  # MLA-like: V wider than Q/K
    cu_t = torch.tensor(cu, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, max_seqlen_q=7, max_seqlen_kv=7)
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (13, 4 * 12)
    torch.testing.assert_close(out.double(), _reference_attention(q, k, v, cu, 8**-0.5), atol=1e-6, rtol=0)


def test_cpu_core_attention_thd_batches_length_groups_exactly_forward_and_backward():
    """Sequences of very different lengths fall into several length groups (one SDPA call each,
    right-padded); the result and every input gradient equal per-sequence float64 attention."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.engine.megatron.cpu.attention import CpuCoreAttention, _length_groups

    lengths = [3, 40, 1, 60, 7, 45, 2]
    assert len(_length_groups(lengths)) == 3  # {1, 2, 3, 7}, {40, 45}, {60}: three calls
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    config = SimpleNamespace(kv_channels=8, attention_dropout=0.0, context_parallel_size=1)
    attn = CpuCoreAttention(config, 1, AttnMaskType.causal, None).eval()
    torch.manual_seed(1)
    q, k, v = (torch.randn(cu[-1], h, 8, requires_grad=True) for h in (4, 2, 2))
    cu_t = torch.tensor(cu, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, max_seqlen_q=60, max_seqlen_kv=60)
    out = attn(q, k, v, None, packed_seq_params=params)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = _reference_attention(q64, k64, v64, cu, 8**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)
    want = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cp_size,cp_rank", [(1, 0), (2, 0), (2, 1)])
def test_vectorized_thd_rope_equals_megatrons_loop(cp_size, cp_rank):
    """mcore_fixes._vectorize_thd_rope against megatron's per-sequence loop, bit for bit."""
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.engine.megatron import mcore_fixes

    mcore_fixes.apply()
    group = SimpleNamespace(size=lambda: cp_size, rank=lambda: cp_rank)
    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)  # every length divides by 2 * cp
    torch.manual_seed(0)
    t = torch.randn(24 // cp_size, 3, 10)  # rotary dim 8 of head dim 10: two dims pass through
    freqs = torch.randn(16, 1, 1, 8)  # max_seqlen positions (not the whole stream)
    for interleaved in (False, True):
        kwargs = dict(rotary_interleaved=interleaved, mscale=0.9, cp_group=group)
        fast = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, **kwargs)
        assert rope_utils._apply_rotary_pos_emb_thd is not mcore_fixes.megatron_thd_rope
        torch.testing.assert_close(fast, mcore_fixes.megatron_thd_rope(t, cu, freqs, **kwargs), atol=0, rtol=0)
