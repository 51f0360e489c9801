"""The engine's in-place KV cache (rollout/engine/kv_cache.py) against transformers' DynamicCache.

The same sequence of continuous-batching operations (a padded prefill, decode steps past the
buffer's headroom, rows leaving, leading padding trimmed, a second batch of another width
merged in, more decode steps) runs on both caches through every tiny architecture; every
forward's logits and the final keys and values must be bit-for-bit equal.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.tiny import PRESETS, build_tiny_checkpoint
from megarl.rollout.engine import kv_merge
from megarl.rollout.engine.attn_mask import forward_step, prepare_model
from megarl.rollout.engine.kv_cache import HEADROOM, GrowableLayer, headroom_for, new_engine_cache


def _prefill(model, cache, lengths, g):
    width = max(lengths)
    vocab = model.config.vocab_size
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.randint(5, vocab, (n,), generator=g)
        mask[r, width - n :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = forward_step(model, ids, mask, positions, cache, True)
    return out.logits, mask, positions[:, -1:]


def _decode(model, cache, mask, last, steps, g, logits):
    vocab = model.config.vocab_size
    for _ in range(steps):
        nxt = torch.randint(5, vocab, (mask.shape[0], 1), generator=g)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        last = last + 1
        logits.append(forward_step(model, nxt, mask, last, cache, False).logits)
    return mask, last


def _trim(cache, mask):
    shared = int((mask.cumsum(1) == 0).sum(1).min())
    kv_merge.trim_front(cache, shared)
    return mask[:, shared:]


def _script(model, make_cache):
    """Every operation the scheduler does to a cache; returns all logits and the final cache."""
    g = torch.Generator().manual_seed(0)
    logits = []
    with torch.inference_mode():
        cache = make_cache()
        out, mask, last = _prefill(model, cache, [5, 2, 9, 4], g)
        logits.append(out)
        mask, last = _decode(model, cache, mask, last, 70, g, logits)  # past 64 columns of headroom
        keep = torch.tensor([0, 2, 3])  # row 1 finished; rows 2 and 3 shift down
        cache.batch_select_indices(keep)
        mask, last = mask[keep], last[keep]
        mask = _trim(cache, mask)
        other = make_cache()  # a joining batch, narrower than the running one
        out, omask, olast = _prefill(model, other, [3, 6], g)
        logits.append(out)
        kv_merge.merge_into(cache, other)
        width = max(mask.shape[1], omask.shape[1])
        pad = lambda m: torch.cat([m.new_zeros(m.shape[0], width - m.shape[1]), m], dim=1)  # noqa: E731
        mask, last = torch.cat([pad(mask), pad(omask)]), torch.cat([last, olast])
        mask, last = _decode(model, cache, mask, last, 3, g, logits)
        keep = torch.tensor([4, 3])  # the long rows leave; any order is kept as given
        cache.batch_select_indices(keep)
        mask, last = mask[keep], last[keep]
        mask = _trim(cache, mask)
        wide = make_cache()  # a joining batch wider than the running one
        out, wmask, wlast = _prefill(model, wide, [mask.shape[1] + 7], g)
        logits.append(out)
        kv_merge.merge_into(cache, wide)
        width = max(mask.shape[1], wmask.shape[1])
        mask, last = torch.cat([pad(mask), pad(wmask)]), torch.cat([last, wlast])
        _decode(model, cache, mask, last, 4, g, logits)
    return logits, cache


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_growable_cache_equals_dynamic_cache(tmp_path, preset):
    from transformers import AutoModelForCausalLM, DynamicCache

    path = build_tiny_checkpoint(tmp_path / "m", preset=preset)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prepare_model(model)
    ref_logits, ref_cache = _script(model, DynamicCache)
    # the default headroom, and headrooms sized to short rows (buffers outgrown every few steps,
    # batches of different headrooms merged), as the scheduler sizes them
    small = iter([2, 1, 5])
    for make_cache in (new_engine_cache, lambda: new_engine_cache(next(small))):
        logits, cache = _script(model, make_cache)
        assert all(type(layer) is GrowableLayer for layer in cache.layers)
        assert len(logits) == len(ref_logits)
        for k, (a, b) in enumerate(zip(logits, ref_logits)):
            assert torch.equal(a, b), f"forward {k}: logits differ by {(a - b).abs().max()}"
        for a, b in zip(cache.layers, ref_cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert all(layer.headroom == 5 for layer in cache.layers)  # a merge keeps the larger headroom


def test_headroom_for_the_rows_remaining_tokens():
    """The prefill's token needs no column; each later token needs one; never more than HEADROOM."""
    assert [headroom_for(n) for n in (1, 2, 3, 10)] == [1, 1, 2, 9]
    assert headroom_for(HEADROOM + 1) == HEADROOM and headroom_for(10_000) == HEADROOM


def test_decode_steps_write_in_place():
    """A decode step writes into the buffer's headroom: no new buffer until the headroom is used up."""
    layer = GrowableLayer()
    k = torch.randn(2, 1, 3, 4)
    layer.update(k, k.clone())
    buffer = layer._kbuf
    for step in range(HEADROOM):
        keys, _ = layer.update(torch.full((2, 1, 1, 4), float(step)), torch.zeros(2, 1, 1, 4))
        assert layer._kbuf is buffer and keys.data_ptr() == buffer.data_ptr()
    assert keys.shape[-2] == 3 + HEADROOM
    assert torch.equal(keys[..., :3, :], k) and torch.equal(keys[0, 0, -1], torch.full((4,), 63.0))
    layer.update(torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4))  # the headroom is used up: a new buffer
    assert layer._kbuf is not buffer and layer.keys.shape[-2] == 4 + HEADROOM
    assert torch.equal(layer.keys[..., :3, :], k)


def test_keys_replaced_from_outside_are_moved_into_a_new_buffer():
    """Code that assigns layer.keys (older kv_merge paths, transformers' own methods) is respected."""
    layer = GrowableLayer()
    layer.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    layer.keys, layer.values = torch.ones(1, 1, 5, 4), torch.ones(1, 1, 5, 4)
    keys, values = layer.update(torch.full((1, 1, 1, 4), 2.0), torch.full((1, 1, 1, 4), 2.0))
    assert keys.shape[-2] == 6 and torch.equal(keys[..., :5, :], torch.ones(1, 1, 5, 4))
    assert torch.equal(values[..., 5, :], torch.full((1, 1, 4), 2.0))


def test_rows_leave_in_place():
    """Finished rows leave without a new buffer: the kept rows move down within the same storage."""
    layer = GrowableLayer()
    keys = torch.arange(6.0).reshape(6, 1, 1, 1).expand(6, 1, 2, 4).contiguous()
    layer.update(keys, keys.clone())
    buffer = layer._kbuf.data_ptr()
    layer.select_rows(torch.tensor([0, 2, 3, 5]))
    assert layer._kbuf.data_ptr() == buffer  # the same storage, its first 4 rows
    assert layer.keys[:, 0, 0, 0].tolist() == [0.0, 2.0, 3.0, 5.0]
    assert torch.equal(layer.values, layer.keys)
    layer.update(torch.full((4, 1, 1, 4), 9.0), torch.full((4, 1, 1, 4), 9.0))  # and decoding goes on
    assert layer.keys.shape == (4, 1, 3, 4) and layer.keys[:, 0, 2, 0].tolist() == [9.0] * 4
