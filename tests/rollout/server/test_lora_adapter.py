"""The embedded server's LoRA endpoints (SGLang's /load_lora_adapter_from_tensors, /load_lora_adapter,
/unload_lora_adapter; megarl/rollout/engine/lora.py): the adapter is merged into the weights as
peft merges it, generation names it by lora_path, a second adapter replaces the first instead of
stacking on it, and unloading restores the base bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from megarl.wire.weights_codec import serialize_flattened_bucket

TARGETS = ["q_proj", "v_proj", "down_proj", "lm_head"]
PROMPT = [2, 10, 11, 12, 3]


def _adapter(model_path, seed: int, targets=TARGETS, rank: int = 4):
    """(peft config dict, PEFT-named tensors, the merged HF state peft makes) of a random adapter."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_path), LoraConfig(r=rank, lora_alpha=8, target_modules=targets)
    )
    g = torch.Generator().manual_seed(seed)
    # the LoRA factors (peft adds lm_head's base weight to what it saves when lm_head is targeted)
    factors = {k: v for k, v in get_peft_model_state_dict(model).items() if ".lora_" in k}
    state = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in sorted(factors.items())}
    set_peft_model_state_dict(model, state)
    config = model.peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    return json.loads(json.dumps(config, default=str)), state, model.merge_and_unload().state_dict()


def _load(client, name, config, state):
    return client.post(
        "/load_lora_adapter_from_tensors",
        json={
            "lora_name": name,
            "config_dict": config,
            "serialized_named_tensors": [serialize_flattened_bucket(sorted(state.items()))],
            "load_format": "flattened_bucket",
        },
    )


def _generate(client, **extra):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}, **extra}
    return client.post("/generate", json=body)


@pytest.fixture(scope="module")
def base(engine):
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def test_an_adapter_is_merged_as_peft_merges_it_and_named_by_lora_path(engine, client, base, tiny_model_path):
    config, state, merged = _adapter(tiny_model_path, seed=1)
    response = _load(client, "policy", config, state)
    assert response.status_code == 200 and response.json()["success"], response.text
    live = engine.model.state_dict()
    changed = {k for k in base if not torch.equal(live[k], base[k])}
    assert changed and all(any(f"{t}." in k for t in TARGETS) for k in changed)
    assert max((live[k] - merged[k]).abs().max().item() for k in base) < 1e-6
    assert _generate(client, lora_path="policy").status_code == 200
    refused = _generate(client, lora_path="other")
    assert refused.status_code == 400 and "lora_path='other'" in refused.text and "'policy'" in refused.text


def test_a_new_adapter_replaces_the_old_one_and_unloading_restores_the_base(engine, client, base, tiny_model_path):
    first, state, _ = _adapter(tiny_model_path, seed=1)
    assert _load(client, "policy", first, state).json()["success"]
    # the second adapts fewer modules: q_proj must go back to the base, not keep the first's delta
    second, state2, merged2 = _adapter(tiny_model_path, seed=2, targets=["v_proj"])
    assert _load(client, "policy", second, state2).json()["success"]
    live = engine.model.state_dict()
    assert max((live[k] - merged2[k]).abs().max().item() for k in base) < 1e-6
    wrong = client.post("/unload_lora_adapter", json={"lora_name": "nope"})
    assert wrong.status_code == 400 and "'nope' is not loaded" in wrong.text
    assert client.post("/unload_lora_adapter", json={"lora_name": "policy"}).json()["success"]
    assert all(torch.equal(engine.model.state_dict()[k], base[k]) for k in base)
    assert _generate(client, lora_path="policy").status_code == 400  # nothing is loaded now


def test_a_peft_folder_loads_from_an_allowed_directory(engine, client, base, tiny_model_path, tmp_path):
    from fastapi.testclient import TestClient
    from safetensors.torch import save_file

    from megarl.rollout.server.app import create_app

    config, state, merged = _adapter(tiny_model_path, seed=3)
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file(state, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(config))
    outside = client.post("/load_lora_adapter", json={"lora_name": "from-disk", "lora_path": str(folder)})
    assert outside.status_code == 403 and "lora_path" in outside.text  # the server reads only its weight dirs
    allowed = TestClient(create_app(engine, weight_dirs=[str(tmp_path)]))
    response = allowed.post("/load_lora_adapter", json={"lora_name": "from-disk", "lora_path": str(folder)})
    assert response.json()["success"], response.text
    live = engine.model.state_dict()
    assert max((live[k] - merged[k]).abs().max().item() for k in base) < 1e-6
    bad = {k: v[:2] if "lora_A" in k else v for k, v in state.items()}
    refused = _load(client, "bad", config, bad)
    assert refused.status_code == 400 and "do not fit" in refused.text
    assert client.post("/unload_lora_adapter", json={"lora_name": "from-disk"}).json()["success"]
