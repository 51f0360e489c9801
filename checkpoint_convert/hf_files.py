"""What a Hugging Face checkpoint directory holds, checked against what its config promises.

The expected tensors (names and shapes) come from the transformers model class built on the meta
device (no memory), so a checkpoint is checked against Hugging Face's own definition before any
weight is read: a missing tensor, an unexpected one and a wrong shape are refused by name.
"""

from __future__ import annotations

import json
import os
import re

import torch

from checkpoint_convert import ConvertError

# the trainer's end-of-run export writes the same files (one definition of what is not weights)
from megarl.engine.megatron.hf_export import INDEX  # one definition for the export and the converter


def load_config(path: str):
    """The HF config of a model directory (or a config.json file), refused unless mbridge knows it."""
    from mbridge.core.bridge import _MODEL_REGISTRY
    from transformers import AutoConfig

    config_dir = os.path.dirname(path) if path.endswith(".json") else path
    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        raise ConvertError(f"{path}: no config.json (pass a Hugging Face model directory)")
    try:
        config = AutoConfig.from_pretrained(config_dir)
    except (ValueError, KeyError, OSError) as e:
        raise ConvertError(
            f"{config_dir}/config.json cannot be read by transformers: {str(e).splitlines()[0]}"
        ) from None
    if config.model_type not in _MODEL_REGISTRY:
        raise ConvertError(
            f"unsupported architecture: model_type '{config.model_type}' "
            f"({', '.join(getattr(config, 'architectures', None) or [])}) is not known to mbridge; "
            f"supported: {', '.join(sorted(_MODEL_REGISTRY))}"
        )
    return config


def tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in the safetensors files of `path`, read from headers only."""
    from safetensors import safe_open

    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConvertError(f"{path}: no model.safetensors or {INDEX} (only safetensors checkpoints are converted)")
    shapes = {}
    for name in files:
        with safe_open(os.path.join(path, name), "pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor the transformers model of `config` saves (meta device; a
    vision-language model's under the names its checkpoints use, models/hf_names.py)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from megarl.models.hf_names import model_to_checkpoint
    from megarl.models.vision import VisionSpec

    auto = AutoModelForCausalLM if VisionSpec.of(config) is None else AutoModelForImageTextToText
    with torch.device("meta"):
        model = auto.from_config(config)
    state = model.state_dict()
    saved = model_to_checkpoint(model, list(state))
    shapes = {saved[k]: tuple(v.shape) for k, v in state.items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)  # transformers saves the embedding only
    return shapes


def mtp_tensor(name: str, config) -> bool:
    """A multi-token-prediction layer's tensor (DeepSeek-V3's `model.layers.{num_hidden_layers}.*`):
    neither transformers nor megarl's engine builds those layers."""
    if not getattr(config, "num_nextn_predict_layers", 0):
        return False
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) >= config.num_hidden_layers


def check_tensors(path: str, config) -> list[str]:
    """Refuse a checkpoint whose tensors differ from the config's model; returns the MTP tensors
    that will be dropped (reported in the converted checkpoint's marker)."""
    found = tensor_shapes(path)
    wanted = expected_shapes(config)
    dropped = sorted(n for n in found if n not in wanted and mtp_tensor(n, config))
    missing = sorted(set(wanted) - set(found))
    extra = sorted(set(found) - set(wanted) - set(dropped) - {"lm_head.weight"})
    if missing:
        raise ConvertError(f"{path}: missing tensors {_names(missing)} (the config's model needs them)")
    if extra:
        raise ConvertError(
            f"{path}: unexpected tensors {_names(extra)} (not part of a "
            f"{type(config).__name__} model; refusing to drop them silently)"
        )
    for name, shape in wanted.items():
        if found[name] != shape:
            raise ConvertError(
                f"{path}: shape mismatch for tensor '{name}': {found[name]} in the "
                f"checkpoint, {shape} expected from config.json"
            )
    return dropped


def check_exported(names: set[str], config) -> None:
    """The tensors an export produced are exactly the Hugging Face model's."""
    wanted = set(expected_shapes(config))
    missing, extra = sorted(wanted - names), sorted(names - wanted - {"lm_head.weight"})
    if missing or extra:
        raise ConvertError(
            f"the Megatron checkpoint does not match config.json: missing tensors "
            f"{_names(missing)}, unexpected tensors {_names(extra)}"
        )


def _names(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(f"'{n}'" for n in names[:shown]) + more
