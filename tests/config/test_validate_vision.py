"""A vision-language model's run config (megarl/config/validate_vision.py): configs/vlm-shapes.yaml
validates, what the loop does not run with a vision model yet is refused by key in one line, and
the planner's view of the model is its language model's."""

from __future__ import annotations

import pytest

from megarl.config.loader import ConfigError, load_config
from megarl.config.validate import validate

VLM = "configs/vlm-shapes.yaml"


@pytest.fixture(scope="module")
def vlm_config() -> dict:
    from megarl.models.tiny_vlm import hf_config

    return hf_config().to_dict()


REFUSED = [
    (["trainer.mode=one_step_off", "cluster.placement=disaggregated"], "trainer.mode", "use sync"),
    (["rollout.agent_loop=calculator"], "rollout.agent_loop", "does not send images"),
    (["rollout.tp=2", "cluster.num_actor_ranks=2"], "rollout.tp", "runs a vision-language model whole"),
    (["actor.parallel.cp=2"], "actor.parallel.cp", "context parallel"),
    (["actor.lora.rank=8"], "actor.lora.rank", "LoRA"),
    (["algorithm.adv_estimator=gae", "critic.enabled=true"], "critic.enabled", "critic-free"),
    (["bridge.transport=reshard"], "bridge.transport", "vision tower"),
]


@pytest.mark.parametrize("overrides, key, fragment", REFUSED)
def test_what_a_vision_model_does_not_run_with_is_refused(vlm_config, overrides, key, fragment):
    with pytest.raises(ConfigError) as info:
        validate(load_config(VLM, overrides), vlm_config)
    message = str(info.value)
    assert info.value.key == key and message.startswith(key) and fragment in message, message
    assert "qwen2_5_vl" in message and "\n" not in message


def test_the_vlm_config_validates_and_sizes_come_from_the_text_config(vlm_config):
    from megarl.config.validate_vision import text_view

    cfg = validate(load_config(VLM), vlm_config)
    assert cfg.model.preset == "tiny-qwen2.5-vl"
    view = text_view(vlm_config)
    assert view["model_type"] == "qwen2" and view["num_hidden_layers"] == vlm_config["text_config"]["num_hidden_layers"]
    assert view["image_token_id"] == vlm_config["image_token_id"]
    # tp must divide the text model's heads (4): a check that reads the text config
    with pytest.raises(ConfigError, match="actor.parallel.tp"):
        validate(load_config(VLM, ["actor.parallel.tp=3", "cluster.num_actor_ranks=3"]), vlm_config)
    text = {"model_type": "qwen3", "num_hidden_layers": 2}
    assert text_view(text) is text
