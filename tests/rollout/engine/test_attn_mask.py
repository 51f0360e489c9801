"""The engine's own 4-D attention mask and grouped-KV attention (rollout/engine/attn_mask.py) against
transformers' mask creation and sdpa attention.

Reference: the HF model as loaded (sdpa), given the 2-D padding mask, so transformers builds
the 4-D mask itself (masking_utils) and repeats the grouped KV heads. The engine's mask must give bit-for-bit the same logits and KV cache on
every tiny architecture, in a padded prefill and in a decode step on the padded cache, with
rows of different lengths and positions (as continuous batching lays them out).
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.tiny import PRESETS, build_tiny_checkpoint
from megarl.rollout.engine.attn_mask import ENGINE_SDPA, forward_step, model_attention_mask, prepare_model


def _hf_step(model, ids, mask, positions, cache, keep_all):
    return model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=0 if keep_all else 1,
    )


def _run(step, model):
    """A left-padded prefill of three rows (lengths 5, 2, 7), then two decode steps."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    lengths, width = [5, 2, 7], 7
    vocab = model.config.vocab_size
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.randint(5, vocab, (n,), generator=g)
        mask[r, width - n :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    outs = [step(model, ids, mask, positions, cache, True).logits]
    last = positions[:, -1:]
    for _ in range(2):
        nxt = torch.randint(5, vocab, (3, 1), generator=g)
        mask = torch.cat([mask, mask.new_ones(3, 1)], dim=1)
        last = last + 1
        outs.append(step(model, nxt, mask, last, cache, False).logits)
    return outs, cache


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_engine_mask_equals_transformers_mask(tmp_path, preset):
    from transformers import AutoModelForCausalLM

    path = build_tiny_checkpoint(tmp_path / preset, seed=0, preset=preset)
    engine_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prepare_model(engine_model)  # as the engine's ranks do (RankWorker)
    assert engine_model.config._attn_implementation == ENGINE_SDPA
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf_model.config._attn_implementation == "sdpa"
    with torch.inference_mode():
        ours, our_cache = _run(forward_step, engine_model)
        theirs, their_cache = _run(_hf_step, hf_model)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    for layer_a, layer_b in zip(our_cache.layers, their_cache.layers):
        assert torch.equal(layer_a.keys, layer_b.keys) and torch.equal(layer_a.values, layer_b.values)


def test_mask_layout_and_passthrough():
    from types import SimpleNamespace

    sdpa = SimpleNamespace(_attn_implementation="sdpa")
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    out = model_attention_mask(sdpa, mask, 2, torch.float32)
    assert out.shape == (2, 1, 2, 4) and out.dtype == torch.bool
    # row 0: column 0 is padding; query 0 (position of column 2) sees columns 1..2, query 1 sees 1..3
    assert out[0, 0].tolist() == [[False, True, True, False], [False, True, True, True]]
    assert out[1, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    eager = model_attention_mask(SimpleNamespace(_attn_implementation="eager"), mask, 2, torch.float32)
    assert eager.dtype == torch.float32 and torch.equal(eager == 0, out)
    # no padding, sliding windows, other kernels: the 2-D mask goes to HF unchanged
    assert model_attention_mask(sdpa, torch.ones(2, 4, dtype=torch.long), 1, torch.float32).dim() == 2
    sliding = SimpleNamespace(_attn_implementation="sdpa", layer_types=["full_attention", "sliding_attention"])
    assert model_attention_mask(sliding, mask, 2, torch.float32) is mask
    assert (
        model_attention_mask(SimpleNamespace(_attn_implementation="flash_attention_2"), mask, 2, torch.float32) is mask
    )
