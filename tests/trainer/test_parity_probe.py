"""The async loops' check of a weight sync (trainer/parity.probe_engines) against live embedded
engines over HTTP: rows scored by the trainer with the weights it holds (here: the Hugging Face
model of the same checkpoint, independent of the engine's code) against what
each engine computes for the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.config.schema import BridgeConfig
from megarl.data.batch import Batch
from megarl.rollout.client.client import RolloutClient
from megarl.trainer.parity import ParityError, probe_engines
from tests._http import ThreadedServer

TEMPERATURE = 0.8


class Fleet:
    """The part of RolloutFleet the probe uses: engine URLs and a kept client per URL."""

    kept: dict = {}  # across the module's fleets, as one fleet keeps them across steps

    def __init__(self, urls):
        self.engine_urls = urls

    def kept_client(self, url, **kwargs):
        key = (url, tuple(sorted(kwargs.items())))
        if key not in Fleet.kept:
            Fleet.kept[key] = RolloutClient(url, **kwargs)
        return Fleet.kept[key]


@pytest.fixture(scope="module")
def engines(tiny_model_path, tmp_path_factory):
    """Two engines on the session's tiny checkpoint, both labelled version "3"; `other` is a
    checkpoint of the same shape with other weights."""
    from megarl.models.tiny import build_tiny_checkpoint
    from megarl.rollout.engine.generation import GenerationEngine
    from megarl.rollout.server.app import create_app

    other = build_tiny_checkpoint(tmp_path_factory.mktemp("other") / "seed1", seed=1)
    made = [GenerationEngine(str(tiny_model_path), max_batch_size=8, seed=0) for _ in range(2)]
    servers = [
        ThreadedServer(create_app(e, weight_dirs=[str(other.parent), str(tiny_model_path.parent)])).start()
        for e in made
    ]
    for s in servers:
        with RolloutClient(s.url) as c:
            c.update_weights_from_disk(str(tiny_model_path), weight_version="3")
    yield [s.url for s in servers], other
    for s in servers:
        s.stop()
    for e in made:
        e.close()


def _rows(model_path) -> Batch:
    """Six rows (prompt + response, right-padded, one response cut short), their old log-probs
    from the Hugging Face model of `model_path`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompts = [[2, 10 + i, 11 + i] for i in range(6)]
    responses = [[40 + i, 41, 42, 43] if i != 4 else [40, 41] for i in range(6)]
    R, T = 4, 7
    input_ids = torch.zeros(6, T, dtype=torch.long)
    mask, old = torch.zeros(6, R), torch.zeros(6, R)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, : len(r)] = 1
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : -1] / TEMPERATURE
        old[i, : len(r)] = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
    return Batch(
        {"input_ids": input_ids, "prompt_lengths": torch.full((6,), 3), "response_mask": mask, "old_log_probs": old},
        non_tensors={"rollout_weight_version": np.array(["2"] * 6, dtype=object)},
    )


def test_engines_holding_the_trainers_weights_pass(engines, tiny_model_path):
    urls, _ = engines
    metrics = probe_engines(_rows(tiny_model_path), 5, BridgeConfig(), 3, Fleet(urls), TEMPERATURE, 4)
    assert metrics["parity/engines"] == 2 and metrics["parity/rows"] == 8 and metrics["parity/rows_off"] == 0
    assert metrics["parity/diff_max"] < 1e-5 and metrics["parity/nonfinite"] == 0


def test_an_engine_with_other_weights_under_the_right_version_fails(engines, tiny_model_path):
    """A sync that went wrong in transit: the engine says version 3 but holds other weights."""
    urls, other = engines
    with RolloutClient(urls[1]) as c:
        c.update_weights_from_disk(str(other), weight_version="3")
    try:
        with pytest.raises(ParityError, match="step 5: rollout server and trainer log-probs differ"):
            probe_engines(_rows(tiny_model_path), 5, BridgeConfig(), 3, Fleet(urls), TEMPERATURE, 4)
    finally:
        with RolloutClient(urls[1]) as c:
            c.update_weights_from_disk(str(tiny_model_path), weight_version="3")


def test_an_engine_on_another_version_fails_and_a_dead_one_is_counted(engines, tiny_model_path):
    urls, _ = engines
    rows = _rows(tiny_model_path)
    with pytest.raises(ParityError, match=r"answers with weight version \['3'\] after the sync of version 4"):
        probe_engines(rows, 5, BridgeConfig(), 4, Fleet(urls), TEMPERATURE, 4)
    metrics = probe_engines(rows, 5, BridgeConfig(), 3, Fleet([urls[0], "http://127.0.0.1:9"]), TEMPERATURE, 4)
    assert metrics["parity/engines"] == 1 and metrics["parity/engines_unreachable"] == 1
