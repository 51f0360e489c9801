"""A tiny random Qwen2.5-VL checkpoint built in code, and the inputs of a prompt with images.

tiny-qwen2.5-vl: tiny.py's character vocabulary (64 ids) with Qwen's vision tokens added at ids
51..54, a language model of hidden 64 and 2 layers (tiny-qwen2's sizes: q/k/v biases, grouped
query attention) and a vision tower of depth 2 and width 32 whose last block attends over the
whole image and the first within windows of 112 pixels (4 x 4 merged patches), so both of the
tower's attention kinds run on an image of more than 112 pixels a side. Norm weights and biases
are random (tiny_archs.perturb_constant_tensors, and the merger's norm `ln_q`, which that does not
recognise by name), so a dropped or swapped mapping shows.

The token ids are the checkpoint's own, not Qwen's released 151652..151656: Megatron's positions
come from the config (engine/megatron/vlm.py), which keeps the vocabulary, and so the tests, small.

Images become model inputs as models/vision.py makes them (the image processor built without a hub
here, `image_processor`, is saved with the checkpoint).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megarl.models.tiny import CHARS, CHAT_TEMPLATE, SPECIAL_TOKENS
from megarl.models.tiny_archs import _COMMON, perturb_constant_tensors
from megarl.models.vision import encode_prompt, image_processor

__all__ = [
    "PRESET",
    "TOKEN_IDS",
    "build_tiny_vlm_checkpoint",
    "build_tokenizer",
    "encode_prompt",
    "hf_config",
    "image_processor",
]

PRESET = "tiny-qwen2.5-vl"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_FIRST_VISION_ID = len(SPECIAL_TOKENS) + len(CHARS)  # 51: right after tiny.py's vocabulary
TOKEN_IDS = dict(
    vision_start_token_id=_FIRST_VISION_ID,
    vision_end_token_id=_FIRST_VISION_ID + 1,
    image_token_id=_FIRST_VISION_ID + 2,
    video_token_id=_FIRST_VISION_ID + 3,
)

# the text model of the other tiny presets (tiny_archs.py)
TEXT_CONFIG = {k: v for k, v in _COMMON.items() if k != "torch_dtype"} | dict(
    num_hidden_layers=2,
    use_sliding_window=False,
    # head_dim 16: the rotary pairs (8) split over time, height and width
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
)

VISION_CONFIG = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,  # the text hidden size: the merger's output are token embeddings
    hidden_act="silu",
    in_channels=3,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=112,
    fullatt_block_indexes=[1],
    tokens_per_second=2,
    initializer_range=0.02,
)


def build_tokenizer():
    """tiny.py's character tokenizer and chat template, plus the vision tokens at TOKEN_IDS."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS + VISION_TOKENS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS + VISION_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hf_config(text: dict | None = None, vision: dict | None = None):
    """The preset's Qwen2_5_VLConfig; `text` / `vision` override entries of its two parts."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config={**TEXT_CONFIG, **(text or {})},
        vision_config={**VISION_CONFIG, **(vision or {})},
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        torch_dtype="float32",
        **TOKEN_IDS,
    )


def build_tiny_vlm_checkpoint(
    out_dir: str | os.PathLike, seed: int = 0, text: dict | None = None, vision: dict | None = None
) -> Path:
    """Write a randomly initialised tiny-qwen2.5-vl HF checkpoint (config, weights, tokenizer,
    image processor) to `out_dir` and return it. Deterministic for a given seed and overrides;
    written to a temporary sibling and renamed, so a crash never leaves a half-written checkpoint
    that a later run would trust."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    out = Path(out_dir)
    recipe = {"preset": PRESET, "seed": seed, "text": text or {}, "vision": vision or {}}
    marker = out / "megarl_tiny.json"
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = hf_config(text, vision)
    with torch.random.fork_rng():  # seeded init without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).float().eval()
        generator = torch.Generator().manual_seed(seed + 1)
        perturb_constant_tensors(model, generator)
        with torch.no_grad():
            ln_q = model.model.visual.merger.ln_q.weight
            ln_q.add_(torch.randn(ln_q.shape, generator=generator) * 0.1)
    model.save_pretrained(tmp, safe_serialization=True)
    build_tokenizer().save_pretrained(tmp)
    image_processor(config).save_pretrained(tmp)
    (tmp / "megarl_tiny.json").write_text(json.dumps(recipe))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
