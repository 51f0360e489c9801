"""LoRA through the trainer (configs/quickstart-lora.yaml, shortened): every sync sends only the
adapted tensors, merged, and the engines' log-probs still equal the trainer's; sending the adapters
themselves (bridge.transport=adapter) gives the same run; a run stopped at a
checkpoint (adapters and their optimizer state, the base named) and resumed equals the
uninterrupted run step for step; the end-of-run exports (merged HF folder, PEFT folder) and
`megarl export` of the checkpoint agree."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests._procs import _start, assert_runs_identical, run_cli, whole_and_resumed
from tests.trainer.test_durability import _finish, _tensors

STEPS = 6
RUN = [
    "configs/quickstart-lora.yaml",
    "data.num_train=64",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=64",
    "trainer.val_every=0",
    "trainer.loggers=[console,jsonl]",
    "trainer.deterministic=true",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_run")
    background = ThreadPoolExecutor(1)  # the adapter-transport run beside the whole and resumed ones
    adapter = [*RUN, f"trainer.total_steps={STEPS}", f"trainer.output_dir={root}/adapter", "bridge.transport=adapter"]
    adapter_run = background.submit(
        lambda: _finish(_start(["train", *adapter, "trainer.export_hf=false"], uuid.uuid4().hex))
    )
    resumed = whole_and_resumed(root, RUN, STEPS)
    adapter_run.result()
    background.shutdown()
    return {
        "whole": root / "whole" / "quickstart-lora",
        "cut": root / "cut" / "quickstart-lora",
        "adapter": root / "adapter" / "quickstart-lora",
        "resumed": resumed,
    }


def _records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_syncs_send_only_the_adapted_tensors_and_parity_holds(runs):
    records = _records(runs["whole"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    exported = _tensors(runs["whole"] / "hf")
    adapted = {k: v for k, v in exported.items() if k.endswith(("proj.weight", "lm_head.weight"))}
    assert 0 < len(adapted) < len(exported)  # embedding and norms stay frozen and are never sent
    for r in records:
        assert r["bridge/tensors"] == len(adapted)
        assert r["bridge/bytes"] == sum(v.numel() * v.element_size() for v in adapted.values())
        assert r["rollout/logprob_diff_max"] <= 1e-4
    assert len({r["actor/pg_loss"] for r in records}) > 1


def test_syncing_the_adapters_themselves_equals_syncing_merged_weights(runs):
    """bridge.transport=adapter: the engine loads the adapters (/load_lora_adapter_from_tensors) and
    merges them with the trainer's arithmetic, so the run is the merged-weight run step for step,
    while each sync moves the adapters' bytes only."""
    merged, adapter = _records(runs["whole"]), _records(runs["adapter"])
    peft = _tensors(runs["whole"] / "lora")  # the adapters' tensors (their values differ by step, not their sizes)
    for m, a in zip(merged, adapter, strict=True):
        assert (a["reward/mean"], a["actor/pg_loss"]) == (m["reward/mean"], m["actor/pg_loss"]), a["step"]
        assert a["rollout/logprob_diff_max"] <= 1e-4
        assert a["bridge/tensors"] == len(peft)
        assert a["bridge/bytes"] == sum(v.numel() * v.element_size() for v in peft.values()) < m["bridge/bytes"]


def test_a_resumed_lora_run_equals_the_uninterrupted_one(runs):
    assert "resumed from" in runs["resumed"]
    cut = _records(runs["cut"])
    assert [r["step"] for r in cut] == list(range(1, STEPS + 1))
    assert_runs_identical(runs["whole"], runs["cut"], STEPS)
    ckpt = json.loads(
        (runs["cut"] / "checkpoints" / f"step_{STEPS // 2:06d}" / "actor" / "megarl_ckpt.json").read_text()
    )
    assert ckpt["lora"]["base"].endswith("init_model") and ckpt["lora"]["rank"] == 16


def test_peft_folder_on_the_base_equals_the_merged_export(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = runs["whole"]
    config = json.loads((run / "lora" / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]).double()
    adapted = PeftModel.from_pretrained(base, run / "lora").merge_and_unload()
    merged = AutoModelForCausalLM.from_pretrained(run / "hf").double()
    ids = torch.tensor([[2, 10, 11, 12, 3, 13, 14]])
    with torch.no_grad():
        got, want = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-5
    initial = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]).double()
    with torch.no_grad():
        assert (initial(input_ids=ids).logits - want).abs().max() > 1e-3  # the adapters moved it


def test_megarl_export_of_a_lora_checkpoint_equals_the_end_of_run_export(runs, tmp_path):
    out = run_cli("export", runs["cut"], "--step", STEPS, "--out", tmp_path / "hf")
    assert out.returncode == 0, out.stdout + out.stderr
    mine, final = _tensors(tmp_path / "hf"), _tensors(runs["cut"] / "hf")
    assert mine.keys() == final.keys()
    assert max((mine[k] - final[k]).abs().max().item() for k in final) < 1e-6
    peft_mine, peft_final = _tensors(tmp_path / "hf" / "lora"), _tensors(runs["cut"] / "lora")
    assert peft_mine.keys() == peft_final.keys() and all(torch.equal(peft_mine[k], peft_final[k]) for k in peft_final)
