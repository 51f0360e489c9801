"""The parameters of actor.lora's adapters per rank of each pipeline stage: what the memory model
counts for gradients and optimizer state when the base is frozen.

An adapter on a linear [in -> out] of rank r has r * (in + out) parameters. Partitioned like the
engine does (engine/megatron/lora.py): on a column-parallel layer A is whole and B split over
the layer's tensor-parallel group, on a row-parallel one A split and B whole; experts over
expert-TP, each rank holding its EP share of them.
"""

from __future__ import annotations

from megarl.perf.flops import _as_dict, _attention_dims, _head_dim, _is_moe_layer


def _targeted(name: str, targets) -> bool:
    # the planner has no module tree: a target is matched by its last part (PEFT's rule on the
    # short name), "all-linear" by the attention and MLP linears (config/validate_lora.py)
    from megarl.config.validate_lora import ALL_LINEAR, ALL_LINEAR_MODULES

    return any(t.rsplit(".", 1)[-1] == name or (t == ALL_LINEAR and name in ALL_LINEAR_MODULES) for t in targets)


def _attention_linears(cfg: dict) -> list[tuple[str, int, int, str]]:
    h = cfg["hidden_size"]
    if cfg["model_type"] == "deepseek_v3":  # MLA: only o_proj takes an adapter
        n, _, v = _attention_dims(cfg)
        return [("o_proj", n * v, h, "row")]
    n, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], _head_dim(cfg)
    return [
        ("q_proj", h, n * hd, "column"),
        ("k_proj", h, kv * hd, "column"),
        ("v_proj", h, kv * hd, "column"),
        ("o_proj", n * hd, h, "row"),
    ]


def _mlp_linears(h: int, ffn: int) -> list[tuple[str, int, int, str]]:
    return [("gate_proj", h, ffn, "column"), ("up_proj", h, ffn, "column"), ("down_proj", ffn, h, "row")]


def _per_rank(linears, rank: int, targets, tp: int) -> float:
    total = 0.0
    for name, d_in, d_out, kind in linears:
        if _targeted(name, targets):
            total += rank * (d_in + d_out / tp) if kind == "column" else rank * (d_in / tp + d_out)
    return total


def lora_stage_params(hf, p, lora) -> list[tuple[float, float]]:
    """(dense, expert) adapter parameters per rank of each pipeline stage of layout `p` (a
    ParallelConfig) for `lora` (actor.lora; rank 0: none)."""
    from megarl.config.validate_pipeline import stage_layers

    cfg = _as_dict(hf)
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    out, start = [], 0
    for s, n in enumerate(stage_layers(p, n_layers)):
        dense = expert = 0.0
        if lora.rank:
            for i in range(start, start + n):
                dense += _per_rank(_attention_linears(cfg), lora.rank, lora.target_modules, p.tp)
                if not _is_moe_layer(cfg, i):
                    dense += _per_rank(_mlp_linears(h, cfg["intermediate_size"]), lora.rank, lora.target_modules, p.tp)
                    continue
                n_exp = cfg["num_experts"] if cfg["model_type"] == "qwen3_moe" else cfg["n_routed_experts"]
                one = _mlp_linears(h, cfg["moe_intermediate_size"])
                expert += n_exp / p.ep * _per_rank(one, lora.rank, lora.target_modules, p.etp)
                shared = cfg.get("n_shared_experts") or 0
                dense += shared * _per_rank(one, lora.rank, lora.target_modules, p.tp)
            if s == p.pp - 1:
                dense += _per_rank([("lm_head", h, cfg["vocab_size"], "column")], lora.rank, lora.target_modules, p.tp)
        out.append((dense, expert))
        start += n
    return out
