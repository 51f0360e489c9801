"""How a parallel layout's pipeline splits the model's layers (pure; used by validate and the engine).

Even split (first_stage_layers = last_stage_layers = None): pp divides num_hidden_layers, and with
vpp > 1 (interleaved 1F1B) pp*vpp does, so every virtual stage holds the same number of layers.

Uneven split, Megatron's num_layers_in_first/last_pipeline_stage: the first and/or last stage hold
the layers given, the middle stages share the rest evenly; with vpp > 1 each stage's count is a
multiple of vpp. Models whose depth has few divisors need it: DeepSeek-V3 has 61 layers (a prime),
Qwen3-235B-A22B 94 (2 * 47), so pp=16 or pp=8 exist only as uneven splits.
"""

from __future__ import annotations

from megarl.config.loader import ConfigError


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def check_virtual_pipeline(p, num_layers: int | None, key: str = "actor.parallel") -> None:
    """vpp's rules (ParallelConfig `p`); also called by the engine, which may be built without a
    RunConfig. num_layers None: only the rules that do not depend on the model."""
    if p.vpp == 1:
        return
    _require(
        p.pp > 1,
        f"{key}.vpp",
        f"{key}.vpp={p.vpp} needs {key}.pp > 1 (virtual stages interleave over pipeline ranks); set vpp=1 or raise pp",
    )
    if num_layers and not _uneven(p):
        _require(
            num_layers % (p.pp * p.vpp) == 0,
            f"{key}.vpp",
            f"{key}.pp*vpp={p.pp}*{p.vpp}={p.pp * p.vpp} does not divide "
            f"model.num_hidden_layers={num_layers}; every virtual stage needs the same number "
            "of layers (choose vpp so that pp*vpp divides it; a preset's depth is set by "
            "model.num_hidden_layers)",
        )


def _uneven(p) -> bool:
    return p.first_stage_layers is not None or p.last_stage_layers is not None


def check_stage_options(p, key: str = "actor.parallel") -> None:
    """The uneven-split options alone (no model needed)."""
    for name in ("first_stage_layers", "last_stage_layers"):
        value = getattr(p, name)
        if value is None:
            continue
        _require(value >= 1, f"{key}.{name}", f"{key}.{name}={value} must be >= 1 or null (an even split)")
        _require(p.pp > 1, f"{key}.{name}", f"{key}.{name}={value} needs {key}.pp > 1; set it to null or raise pp")
        _require(
            value % p.vpp == 0,
            f"{key}.{name}",
            f"{key}.{name}={value} must be a multiple of {key}.vpp={p.vpp} (each virtual "
            "stage of the rank holds the same number of layers)",
        )


def stage_layers(p, num_layers: int, key: str = "actor.parallel") -> list[int]:
    """Layers held by each pipeline rank, first to last; ConfigError naming the key if the split
    does not exist."""
    check_stage_options(p, key)
    if not _uneven(p):
        _require(
            num_layers % p.pp == 0,
            f"{key}.pp",
            f"{key}.pp={p.pp} does not divide model.num_hidden_layers={num_layers}"
            + (
                ""
                if p.pp == 1
                else f"; set {key}.first_stage_layers / last_stage_layers for an uneven split, or choose a divisor"
            ),
        )
        check_virtual_pipeline(p, num_layers, key)
        return [num_layers // p.pp] * p.pp
    first, last = p.first_stage_layers, p.last_stage_layers
    ends = [n for n in (first, last) if n is not None]
    middle_stages = p.pp - len(ends)
    rest = num_layers - sum(ends)
    given = f"{key}.first_stage_layers={first}, last_stage_layers={last}"
    _require(rest >= 0, f"{key}.first_stage_layers", f"{given} exceed model.num_hidden_layers={num_layers}")
    if middle_stages == 0:
        _require(
            rest == 0,
            f"{key}.first_stage_layers",
            f"{given} with {key}.pp={p.pp} must add up to model.num_hidden_layers={num_layers}",
        )
    else:
        _require(
            rest > 0 and rest % middle_stages == 0,
            f"{key}.first_stage_layers",
            f"{given} leave {rest} of model.num_hidden_layers={num_layers} layers for "
            f"{middle_stages} middle pipeline stages ({key}.pp={p.pp}); they must split evenly "
            f"(e.g. 61 layers, pp=16: first_stage_layers=3, last_stage_layers=2, 4 in each middle stage)",
        )
        per_middle = rest // middle_stages
        _require(
            per_middle % p.vpp == 0,
            f"{key}.vpp",
            f"{key}.vpp={p.vpp} does not divide the {per_middle} layers of each middle pipeline stage",
        )
    middle = [rest // middle_stages] * middle_stages if middle_stages else []
    return ([first] if first is not None else []) + middle + ([last] if last is not None else [])
