"""A vision-language model's run: what of the loop it runs with today, refused at start otherwise.

Its config.json nests the language model's sizes under `text_config`; `text_view` lifts them to
the top level, where the other checks (heads, layers, vocabulary) read them.
"""

from __future__ import annotations

from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig

# model_types of the vision-language models megarl builds (models/vision.py, engine/megatron/vlm.py)
VISION_MODEL_TYPES = ("qwen2_5_vl",)
LANGUAGE_MODEL_TYPES = {"qwen2_5_vl": "qwen2"}  # the architecture of each one's language model


def is_vision_language(model_config: dict | None) -> bool:
    return (model_config or {}).get("model_type") in VISION_MODEL_TYPES


def text_view(model_config: dict | None) -> dict | None:
    """A vision-language model's config seen as its language model's: text_config's entries at
    the top level (the top level's other keys kept) and that architecture's model_type, which the
    planner's and the MFU's FLOPs models know (the vision tower's parameters and FLOPs are not
    counted). Any other config as it is."""
    if not is_vision_language(model_config) or not isinstance(model_config.get("text_config"), dict):
        return model_config
    top = {k: v for k, v in model_config.items() if k != "text_config"}
    return {**model_config["text_config"], **top, "model_type": LANGUAGE_MODEL_TYPES[model_config["model_type"]]}


def check_vision(cfg: RunConfig, model_config: dict | None) -> None:
    if not is_vision_language(model_config):
        return
    a, r = cfg.actor, cfg.rollout
    refusals = [
        ("trainer.mode", cfg.trainer.mode != "sync", f"trainer.mode={cfg.trainer.mode}: use sync"),
        ("rollout.agent_loop", r.agent_loop is not None, "the agent loop does not send images yet; set it to null"),
        (
            "rollout.tp",
            r.backend == "embedded" and r.tp > 1,
            f"rollout.tp={r.tp}: the embedded engine runs a vision-language model whole; use 1",
        ),
        (
            "actor.parallel.pp",
            a.parallel.pp > 1 or a.parallel.vpp > 1,
            "the vision tower runs on one pipeline stage; use pp=1, vpp=1",
        ),
        ("actor.parallel.cp", a.parallel.cp > 1, "context parallel does not split image tokens yet; use cp=1"),
        (
            "actor.lora.rank",
            a.lora.rank > 0,
            "LoRA on a vision-language model is not supported yet; set actor.lora.rank=0",
        ),
        (
            "critic.enabled",
            cfg.critic.enabled,
            "a value model of a vision-language model is not supported yet; use a critic-free estimator (grpo, rloo, ...)",
        ),
        (
            "bridge.transport",
            cfg.bridge.transport == "reshard",
            "bridge.transport=reshard does not map the vision tower; use tensor, disk or distributed",
        ),
    ]
    for key, refused, why in refusals:
        if refused:
            raise ConfigError(key, f"{key}: model_type {model_config['model_type']} is a vision-language model: {why}")
