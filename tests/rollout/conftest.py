"""Fixtures shared by the rollout tests: the session's tiny checkpoint as a Hugging Face model
(the independent reference the engine's outputs are checked against) and engines built on it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture()
def make_engine(tiny_model_path):
    """GenerationEngine(tiny checkpoint, **kwargs), closed when the test ends."""
    from megarl.rollout.engine.generation import GenerationEngine

    engines = []

    def make(max_batch_size: int = 4, seed: int = 0, **kwargs):
        engines.append(GenerationEngine(str(tiny_model_path), max_batch_size=max_batch_size, seed=seed, **kwargs))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()
