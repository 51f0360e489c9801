"""actor.lora validation (megarl/config/validate_lora.py): a target that matches nothing, one the
engine cannot adapt, and layouts LoRA does not support yet are refused by key in one line; the
planner counts the adapters as PEFT does (megarl/perf/lora.py)."""

import pytest
import torch

from megarl.models.tiny import TINY_QWEN3_MOE
from tests.config.test_config import test_bad_configs_name_the_key as _check

torch.set_num_threads(1)

KEY = "actor.lora.target_modules"
LORA_CONFIGS = [
    (["actor.lora.rank=8", "actor.lora.target_modules=[q_projj]"], KEY, "'q_projj' matches no linear layer"),
    # the message lists what exists, router included
    (["actor.lora.rank=8", "actor.lora.target_modules=[nope]"], KEY, "'down_proj', 'gate'"),
    (["actor.lora.rank=8", "actor.lora.target_modules=[mlp.gate]"], KEY, "matches ['gate'], which cannot carry"),
    (["actor.lora.rank=8", "actor.lora.target_modules=[]"], KEY, "is empty"),
    (["actor.lora.rank=-1"], "actor.lora.rank", "must be >= 0"),
    (["actor.lora.rank=8", "actor.lora.dropout=1.0"], "actor.lora.dropout", "must be in [0, 1)"),
    (["actor.lora.rank=8", "bridge.transport=reshard"], "bridge.transport", "use tensor, distributed or disk"),
    (["bridge.transport=adapter"], "bridge.transport", "actor.lora is off"),
    (["actor.lora.rank=8", "bridge.transport=adapter", "trainer.mode=fully_async"], "bridge.transport", "fully_async"),
    (["actor.lora.rank=8", "bridge.transport=adapter"], None, None),
    (["actor.lora.rank=8", "actor.parallel.etp=2", "actor.parallel.ep=1"], "actor.parallel.etp", "etp=1"),
    # allowed: PEFT's dotted suffixes, all-linear and the untied head; experts left out under etp=2
    (["actor.lora.rank=8", "actor.lora.target_modules=[self_attn.q_proj,all-linear,lm_head]"], None, None),
    (["actor.lora.rank=8", "actor.parallel.etp=2", "actor.parallel.ep=1", f"{KEY}=[q_proj,o_proj]"], None, None),
    (["actor.lora.target_modules=[nope]"], None, None),  # rank 0: LoRA off, nothing checked
]


@pytest.mark.parametrize("overrides, key, fragment", LORA_CONFIGS)
def test_lora_configs_name_the_key(overrides, key, fragment):
    _check(overrides, key, fragment)


def test_lora_on_a_tied_head_is_refused():
    from megarl.config.loader import ConfigError, load_config
    from megarl.config.validate import validate
    from tests.config.test_config import QUICKSTART, TINY

    cfg = load_config(QUICKSTART, ["actor.lora.rank=8", f"{KEY}=[lm_head]"])
    with pytest.raises(ConfigError, match="tied to the embedding"):
        validate(cfg, {**TINY, "tie_word_embeddings": True})


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"], ["o_proj", "down_proj", "lm_head"]])
def test_planner_counts_adapters_as_peft_does(targets):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.config.schema import LoraConfig as Lora
    from megarl.config.schema import ParallelConfig
    from megarl.perf.lora import lora_stage_params

    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_QWEN3_MOE))
    peft_targets = "all-linear" if targets == ["all-linear"] else targets
    model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=peft_targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if targets == ["all-linear"]:  # PEFT's all-linear also adapts the router (mlp.gate): megarl's does not
        routers = sum(4 * (64 + 4) for n, m in model.named_modules() if n.endswith("mlp.gate") and hasattr(m, "weight"))
        trainable -= routers
    lora = Lora(rank=4, target_modules=targets)
    ((dense, expert),) = lora_stage_params(TINY_QWEN3_MOE, ParallelConfig(), lora)
    assert dense + expert == trainable
    # under EP=2 a rank holds half the experts' adapters, the rest whole
    ((dense2, expert2),) = lora_stage_params(TINY_QWEN3_MOE, ParallelConfig(ep=2), lora)
    assert (dense2, expert2) == (dense, expert / 2)


def test_lora_memory_has_no_base_gradients_or_optimizer_state():
    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.perf.hardware import parse_devices
    from megarl.perf.memory import reference_params_bytes, train_memory
    from tests.config.test_config import QUICKSTART, TINY

    full = validate(load_config(QUICKSTART, ["actor.use_kl_loss=true"]), TINY)
    lora = validate(load_config(QUICKSTART, ["actor.use_kl_loss=true", "actor.lora.rank=4"]), TINY)
    _, device = parse_devices("2xH100")
    a, b = train_memory(full, TINY, device), train_memory(lora, TINY, device)
    assert b.params > a.params  # the base plus the adapters
    assert b.grads < a.grads / 3 and b.optimizer < a.optimizer / 3
    assert reference_params_bytes(full, TINY) > 0 and reference_params_bytes(lora, TINY) == 0


def test_sft_validates_lora_too():
    from pathlib import Path

    from megarl.config.loader import ConfigError, load_config
    from megarl.config.validate_sft import validate_sft
    from tests.config.test_config import TINY

    sft = Path(__file__).resolve().parents[2] / "configs" / "sft-quickstart.yaml"
    cfg = load_config(sft, ["actor.lora.rank=8", f"{KEY}=[nope]"])
    with pytest.raises(ConfigError, match="'nope' matches no linear layer"):
        validate_sft(cfg, TINY)
