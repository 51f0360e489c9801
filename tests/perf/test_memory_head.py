"""The planner's log-prob head memory (perf/memory.py head_bytes) follows the engine's head
(engine/megatron/logprob.py): the same chunk and keep sizes, the same keep-or-recompute decision,
and the kept logits counted exactly where the engine keeps them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_sizes_are_the_engines():
    from megarl.engine.megatron import logprob
    from megarl.perf import memory

    assert memory.HEAD_CHUNK_BYTES == logprob.CHUNK_BYTES
    assert memory.HEAD_KEEP_LOGITS_BYTES == logprob.KEEP_LOGITS_BYTES


@pytest.mark.parametrize("tokens", [1024, 7000, 7200, 16384])
@pytest.mark.parametrize("bf16", [True, False])
def test_keep_decision_and_bytes_match_the_engine(tokens, bf16):
    import torch

    from megarl.engine.megatron.logprob import chunk_tokens, keeps_logits
    from megarl.perf.memory import head_bytes

    vocab_local = 151936
    dtype = torch.bfloat16 if bf16 else torch.float32
    size = dtype.itemsize
    chunk = min(tokens, chunk_tokens(vocab_local))
    work = 2 * chunk * vocab_local * 4 + (chunk * vocab_local * size if bf16 else 0)
    kept = tokens * vocab_local * size
    for mode in ("auto", "keep", "recompute"):
        expected = work + (kept if keeps_logits(mode, tokens, vocab_local, dtype) else 0)
        assert head_bytes(tokens, vocab_local, bf16, mode) == pytest.approx(expected, rel=1e-6), mode
    # the cases straddle the auto budget: 7,000 bf16 tokens keep (2.0 GiB), 7,200 do not
    assert keeps_logits("auto", tokens, vocab_local, dtype) == (kept <= 2 * 2**30)


def test_plan_counts_kept_logits_only_where_kept():
    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.perf.hardware import parse_devices
    from megarl.perf.memory import train_memory

    _, device = parse_devices("16xH100")

    def logits(mode):
        cfg = validate(load_config(str(ROOT / "configs/qwen3-30b-a3b.yaml"), [f"actor.logits_memory={mode}"]))
        hf = json.loads((ROOT / cfg.model.path / "config.json").read_text())
        return train_memory(cfg, hf, device).logits, cfg, hf

    keep, cfg, hf = logits("keep")
    recompute, _, _ = logits("recompute")
    from megarl.perf.memory import micro_batch_tokens

    p = cfg.actor.parallel
    size = 2 if cfg.actor.precision == "bf16" else 4
    expected = micro_batch_tokens(cfg) / p.cp * hf["vocab_size"] / p.tp * size
    assert keep - recompute == pytest.approx(expected, rel=1e-9)
