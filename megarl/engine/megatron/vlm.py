"""Qwen2.5-VL as a Megatron model, built from a Hugging Face checkpoint through mbridge.

mbridge 0.15.1's Qwen2.5-VL bridge knows the names and layouts (the vision tower's fused qkv,
the merger); model.py's local-spec mixin gives it the language model's local layers. What else it
needs to build and run without TransformerEngine, and to equal Hugging Face:

- the vision tower's layers: mbridge asks for TransformerEngine ones; here Megatron's local ViT
  layers with `VisionCoreAttention` (vlm_modules.py) and a column- / row-parallel merger;
- the vision tower's config from the checkpoint's `vision_config`: mbridge writes the released
  towers' into its code (32 layers of width 1280, 16 heads, window 112, ...);
- the image / video token ids from the checkpoint (mbridge's model defaults to Qwen's);
- the layer norms' names: the local spec keeps them as modules of their own, and mbridge looks up
  the `language_model.` / `vision_model.` names exactly, with the layer index at the 4th place;
- the 3-D rotary positions, computed here from the checkpoint's ids (`mrope_position_ids`) and
  taken as given by the model (vlm_modules.Qwen2_5VLImageModel);
- megatron-core 0.19's attention argument (vlm_modules.install_attention_compat).

Tensor parallel works (TP=2 equals Hugging Face; sequence parallel off by default here); one
pipeline stage, no context parallel; images only (no video).
"""

from __future__ import annotations

import os
from copy import deepcopy

import torch
import torch.distributed as dist

from megarl.engine.megatron import mcore_fixes
from megarl.engine.megatron.cpu import compat as cpu_compat
from megarl.engine.megatron.inputs import place
from megarl.engine.megatron.model import _local_spec_mixin
from megarl.engine.megatron.output_head import PolicyHead
from megarl.engine.megatron.weights import load_hf_weights
from megarl.models.vision import mrope_position_ids

MODEL_TYPE = "qwen2_5_vl"
_LM = "language_model.decoder.layers.{layer_number}."
_VIT = "vision_model.decoder.layers.{layer_number}."
_INPUT_NORMS = {
    _LM + "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"],
    _VIT + "input_layernorm.weight": ["visual.blocks.{layer_number}.norm1.weight"],
}
_MLP_NORMS = {  # mbridge routes every name containing "mlp" to the MLP mapping
    _LM + "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
    _VIT + "pre_mlp_layernorm.weight": ["visual.blocks.{layer_number}.norm2.weight"],
}


# ---------------------------------------------------------------- configs and bridge
def vision_transformer_config(lm_config, vision_config):
    """The vision tower's TransformerConfig: sizes from the checkpoint's `vision_config`, the rest
    (RMSNorm, dtype, tensor-parallel size, fusions off) from the language model's config."""
    if vision_config.hidden_act != "silu":
        raise ValueError(
            f"vision_config.hidden_act={vision_config.hidden_act!r}: the Megatron vision tower is built "
            "with a gated SiLU MLP (Qwen2.5-VL's); use a Qwen2.5-VL checkpoint"
        )
    c = deepcopy(lm_config)
    heads = vision_config.num_heads
    sizes = dict(
        num_layers=vision_config.depth,
        hidden_size=vision_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=vision_config.hidden_size // heads,
        ffn_hidden_size=vision_config.intermediate_size,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=True,
        add_qkv_bias=True,
        qk_layernorm=False,
        layernorm_epsilon=1e-6,  # Hugging Face's vision RMSNorms: eps 1e-6 whatever the text's
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # the tower runs whole on one pipeline stage, its windows unsplit
        sequence_parallel=False,
        tp_comm_overlap=False,
        context_parallel_size=1,
        pipeline_model_parallel_size=1,
        num_layers_in_first_pipeline_stage=None,
        num_layers_in_last_pipeline_stage=None,
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        seq_length=1,
        # read by mbridge's Qwen2_5VisionModel
        patch_size=vision_config.patch_size,
        temporal_patch_size=vision_config.temporal_patch_size,
        in_channels=vision_config.in_channels,
        spatial_merge_size=vision_config.spatial_merge_size,
        fullatt_block_indexes=list(vision_config.fullatt_block_indexes),
        _qwen2_5_vl_window_size=vision_config.window_size,
    )
    for key, value in sizes.items():
        setattr(c, key, value)
    return c


def _bridge_class(overrides: dict) -> type:
    from mbridge.models.qwen2_5_vl import Qwen2_5VLBridge

    base = _local_spec_mixin(Qwen2_5VLBridge)

    class LocalQwen2_5VLBridge(base):
        _OTHER_MAPPING = _INPUT_NORMS
        _MLP_MAPPING = {**base._MLP_MAPPING, **_MLP_NORMS}
        _megarl_overrides = dict(overrides)

        def _weight_name_mapping_other(self, name: str) -> list[str]:
            parts = name.split(".")
            layer, parts[3] = parts[3], "{layer_number}"
            key = ".".join(parts)
            if key not in self._OTHER_MAPPING:
                raise NotImplementedError(f"{name}: no Hugging Face name is known for this Qwen2.5-VL parameter")
            return [n.format(layer_number=layer) for n in self._OTHER_MAPPING[key]]

        def _model_provider(self, post_model_creation_callbacks):
            return _provider(self, post_model_creation_callbacks)

        def _get_mcore_config_by_name(self, mcore_weights_name: str):
            # mbridge's TP split and merge read gated_linear_unit from here. The merger's MLP is
            # not gated: with the language model's config its first linear would be cut as gate /
            # up halves (TP=2 log-probs 0.28 off, while the round trip stays exact). mbridge's
            # InternVL3 and Gemma3 bridges answer per tower the same way.
            if mcore_weights_name.startswith("vision_model.projection."):
                return self.vision_projection_config
            if mcore_weights_name.startswith("vision_model."):
                return self.vision_config
            return self.config

    return LocalQwen2_5VLBridge


def _provider(bridge, callbacks):
    """mbridge's provider (pre_process, post_process, vp_stage) -> model, with the local spec."""
    from mbridge.models.qwen2_5_vl.transformer_config import get_vision_projection_config
    from megatron.core.models.gpt.moe_module_specs import MLPSubmodules
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megarl.engine.megatron.vlm_modules import Qwen2_5VLImageModel, VisionCoreAttention, install_attention_compat

    hf = bridge.hf_config
    merge = hf.vision_config.spatial_merge_size

    def provider(pre_process, post_process, vp_stage=None):
        install_attention_compat()
        vision = vision_transformer_config(bridge.config, hf.vision_config)
        projection = get_vision_projection_config(deepcopy(bridge.config), vision.hidden_size, spatial_merge_size=merge)
        bridge.vision_config, bridge.vision_projection_config = vision, projection
        vision_spec = get_vit_layer_with_local_spec()
        vision_spec.submodules.self_attention.submodules.core_attention = VisionCoreAttention
        model = Qwen2_5VLImageModel(
            language_transformer_config=bridge.config,
            language_transformer_layer_spec=bridge._get_transformer_layer_spec(vp_stage),
            language_vocab_size=hf.vocab_size,
            language_max_sequence_length=hf.max_position_embeddings,
            vision_transformer_config=vision,
            vision_transformer_layer_spec=vision_spec,
            vision_projection_config=projection,
            vision_projection_layer_spec=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            vision_projection_type="mlp",
            language_rotary_base=hf.rope_theta,
            pre_process=pre_process,
            post_process=post_process,
            add_encoder=True,
            add_decoder=True,
            parallel_output=True,
            language_share_embeddings_and_output_weights=getattr(hf, "tie_word_embeddings", False),
            image_token_id=hf.image_token_id,
            video_token_id=hf.video_token_id,
            spatial_merge_size=merge,
        )
        for callback in callbacks:
            callback(model, pre_process=pre_process, post_process=post_process, config=bridge.config, hf_config=hf)
        return model

    return provider


def make_vlm_bridge(hf_config, dtype: torch.dtype = torch.float32, **config_overrides):
    """model.make_bridge for a Qwen2.5-VL config: an mbridge bridge that builds local-spec models.
    `config_overrides` go into the language model's TransformerConfig."""
    if hf_config.model_type != MODEL_TYPE:
        raise ValueError(
            f"model.path: model_type '{hf_config.model_type}' is not a vision-language model megarl "
            f"builds; supported: ['{MODEL_TYPE}'] (text models go through model.make_bridge)"
        )
    return _bridge_class(config_overrides)(hf_config, dtype=dtype)


# ---------------------------------------------------------------- build and run
def build_vlm(
    hf_path: str | os.PathLike, dtype: torch.dtype = torch.float32, tp: int = 1, seed: int = 0, **config_overrides
):
    """(bridge, [model]) of the Qwen2.5-VL checkpoint at `hf_path`, its weights loaded, on this
    process's device. The caller has joined torch.distributed; Megatron's model-parallel state is
    set up here (tensor parallel `tp`) unless it already is."""
    cpu_compat.import_megatron()  # first: without torch.compile on CPU
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    if not dist.is_initialized():
        raise RuntimeError("build_vlm: join torch.distributed first")
    cpu_compat.activate()
    mcore_fixes.apply()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    if ps.get_pipeline_model_parallel_world_size() > 1 or ps.get_context_parallel_world_size() > 1:
        raise ValueError(
            "build_vlm: pipeline and context parallel are not supported for vision-language models; use pp=1, cp=1"
        )
    cpu_compat.seed_model_parallel(seed)
    # mbridge turns sequence parallel on with TP > 1, which needs sequences of a multiple of tp
    # tokens: vlm_forward takes rows of any length
    config_overrides.setdefault("sequence_parallel", False)
    bridge = make_vlm_bridge(AutoConfig.from_pretrained(hf_path), dtype=dtype, **config_overrides)
    chunks = [bridge._model_provider([])(pre_process=True, post_process=True)]
    load_hf_weights(bridge, chunks, hf_path)
    place(chunks, dtype)
    return bridge, chunks


def vlm_forward(
    model,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    **language_kwargs,
):
    """The model's output for right-padded rows `input_ids` [b, s] and their images (the image
    processor's `pixel_values` and `image_grid_thw`, images in token order): logits [b, s, V / tp]
    unless `language_kwargs` pass an output_processor."""
    device = next(model.parameters()).device
    positions = mrope_position_ids(input_ids, image_grid_thw, model.image_token_id, model.spatial_merge_size)
    moved = [None if x is None else x.to(device) for x in (input_ids, positions, pixel_values, image_grid_thw)]
    ids, positions, pixel_values, image_grid_thw = moved
    return model(ids, positions, None, pixel_values=pixel_values, image_grid_thw=image_grid_thw, **language_kwargs)


def vlm_log_probs(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(labels[i, t] | input_ids[i, :t+1]) [b, s] in fp32, through the policy's fused head
    (output_head.PolicyHead: vocab-parallel under tensor parallel, no [tokens, vocab] tensor)."""
    head = PolicyHead(temperature=1.0, with_entropy=False)
    output = vlm_forward(model, input_ids, pixel_values, image_grid_thw, output_processor=head.output_processor)
    (log_probs,) = head(output, labels.to(output.hidden.device))
    return log_probs
