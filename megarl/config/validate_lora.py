"""actor.lora: its targets name linear layers the model has, and the engine can adapt them in the
configured layout. PEFT's matching rule is the one the engine applies (engine/megatron/lora.py)."""

from __future__ import annotations

from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig

ALL_LINEAR = "all-linear"
# the HF linears "all-linear" adapts: attention's and the MLP's (dense, experts, shared experts)
ALL_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# and what may be named besides: the output head (PEFT's all-linear leaves it out; an untied one).
# Not the router, or MLA's latent projections (q_a / q_b / kv_a / kv_b), whose Megatron layers are
# not wired for adapters yet.
SUPPORTED = (*ALL_LINEAR_MODULES, "lm_head")


def matches(module: str, targets) -> bool:
    """PEFT's rule (a target is a module's dotted name or its last parts); "all-linear": every
    module the engine adapts."""
    short = module.rsplit(".", 1)[-1]
    return any(
        (t == ALL_LINEAR and short in ALL_LINEAR_MODULES) or module == t or module.endswith("." + t) for t in targets
    )


# experts built to list the module names: every expert has the same ones (a 128-expert, 48-layer
# model takes 13 s to build on the meta device, 2 experts a second)
NAMED_EXPERTS = 2


def hf_linear_modules(model_config: dict) -> list[str]:
    """Dotted names of the model's linear layers (transformers' own model, built on the meta
    device), with NAMED_EXPERTS experts per MoE layer: targets name kinds of module, not one expert."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    capped = {k: min(v, NAMED_EXPERTS) for k, v in model_config.items() if k in ("num_experts", "n_routed_experts")}
    if "num_experts_per_tok" in model_config and capped:
        capped["num_experts_per_tok"] = min(model_config["num_experts_per_tok"], NAMED_EXPERTS)
    if model_config.get("n_group"):
        capped.update(n_group=1, topk_group=1)
    config = AutoConfig.for_model(**{**model_config, **capped})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def check_lora(cfg: RunConfig, model_config: dict | None) -> None:
    lora, key = cfg.actor.lora, "actor.lora"
    _require(lora.rank >= 0, f"{key}.rank", f"{key}.rank={lora.rank} must be >= 0 (0: LoRA off)")
    _require(
        cfg.bridge.transport != "adapter" or lora.rank > 0,
        "bridge.transport",
        "bridge.transport=adapter sends LoRA adapters, and actor.lora is off; set actor.lora.rank or another transport",
    )
    if lora.rank == 0:
        return
    _require(
        cfg.bridge.transport != "adapter" or cfg.trainer.mode != "fully_async",
        "bridge.transport",
        "bridge.transport=adapter with trainer.mode=fully_async is not supported yet (requests in flight would "
        "name an adapter being replaced); use trainer.mode=sync or one_step_off, or bridge.transport=tensor",
    )
    _require(lora.alpha > 0, f"{key}.alpha", f"{key}.alpha={lora.alpha} must be > 0 (the scale is alpha / rank)")
    _require(0 <= lora.dropout < 1, f"{key}.dropout", f"{key}.dropout={lora.dropout} must be in [0, 1)")
    _require(bool(lora.target_modules), f"{key}.target_modules", f"{key}.target_modules is empty; name the modules")
    _require(
        cfg.bridge.transport != "reshard",
        "bridge.transport",
        "bridge.transport=reshard does not send LoRA-merged weights yet; use tensor, distributed or disk with actor.lora",
    )
    if model_config is None:
        return
    linears = hf_linear_modules(model_config)
    shorts = sorted({n.rsplit(".", 1)[-1] for n in linears})
    for target in lora.target_modules:
        hit = [n for n in linears if matches(n, [target])]
        _require(
            bool(hit),
            f"{key}.target_modules",
            f"{target!r} matches no linear layer of the model; its linear layers are {shorts} (or 'all-linear')",
        )
        odd = sorted({n.rsplit(".", 1)[-1] for n in hit} - set(SUPPORTED))
        _require(
            not odd,
            f"{key}.target_modules",
            f"{target!r} matches {odd}, which cannot carry an adapter yet; adaptable: {list(SUPPORTED)}",
        )
    _require(
        not model_config.get("tie_word_embeddings")
        or not any(matches(n, lora.target_modules) for n in linears if n.endswith("lm_head")),
        f"{key}.target_modules",
        "lm_head is tied to the embedding in this model; an adapter would untie them: leave lm_head out",
    )
    experts = [n for n in linears if ".experts." in n and matches(n, lora.target_modules)]
    _require(
        not experts or cfg.actor.parallel.etp == 1,
        "actor.parallel.etp",
        f"LoRA on experts with expert tensor parallel (etp={cfg.actor.parallel.etp}) is not supported yet; "
        "use etp=1 or leave the experts out of actor.lora.target_modules",
    )
