"""Tiny checkpoints built in code: HF config, a character tokenizer, random weights.

Presets: tiny-qwen3-moe (here, the default), tiny-qwen3-moe-tools (the same with a tool-calling
vocabulary, for the agent loop) and the architectures of tiny_archs.py (Qwen2, Qwen3,
Llama, DeepSeek-V3).

The result is an ordinary Hugging Face model directory (config.json, tokenizer files,
model.safetensors), so every consumer loads it the way it would load a real checkpoint:
the Megatron engine through mbridge, the rollout server through transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megarl.models.tiny_archs import ARCH_PRESETS, perturb_constant_tensors

SPECIAL_TOKENS = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz +-*=?:,.\n")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# hidden 64, 2 layers, 4 experts top-2, vocab 64: small enough to train from scratch on a laptop
# CPU, and every dimension divisible by 2 so TP=2 and EP=2 both apply.
TINY_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.0,
    output_router_logits=False,
    initializer_range=0.02,
    torch_dtype="float32",
    bos_token_id=None,
    eos_token_id=1,
    pad_token_id=0,
)

# tiny-qwen3-moe-tools: the same model with a 128-token vocabulary whose tokenizer also has every
# printable ASCII character and Qwen's tool-call markers (megarl/rollout/agent, the agent example),
# and 512 positions (a few-shot prompt plus tool turns): ids 0..50 are tiny-qwen3-moe's.
TOOLS_PRESET = "tiny-qwen3-moe-tools"
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# An assistant turn ends with <eos>, as Qwen's ends with <|im_end|>: the token SFT teaches the model
# to end its answer with, and the engine stops at.
TOOLS_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|user|>{% endif %}"
    "<tool_response>{{ m['content'] }}</tool_response>"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<eos>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

PRESETS = {
    "tiny-qwen3-moe": TINY_QWEN3_MOE,
    TOOLS_PRESET: {**TINY_QWEN3_MOE, "vocab_size": 128, "max_position_embeddings": 512},
    **ARCH_PRESETS,
}


def preset_overrides(model_cfg) -> dict:
    """The HF-config changes a run's `model` section asks of its preset (model.num_hidden_layers)."""
    n = model_cfg.num_hidden_layers
    return {} if n is None else {"num_hidden_layers": n}


def build_tokenizer(tools: bool = False):
    """Character-level tokenizer with a chat template; ids 0..len(vocab)-1 (51 < vocab_size).
    tools: also the tool markers (plain added tokens, kept in decoded text as Qwen's are) and
    the rest of printable ASCII (105 ids), with a template that renders role "tool" as
    <|user|><tool_response>...</tool_response> and ends assistant turns with <eos> (TOOLS_PRESET)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    extra = TOOL_TOKENS + [chr(c) for c in range(32, 127) if chr(c) not in CHARS] if tools else []
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS + extra)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    if tools:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
    return fast


def build_tiny_checkpoint(
    out_dir: str | os.PathLike, seed: int = 0, preset: str = "tiny-qwen3-moe", **overrides
) -> Path:
    """Write a randomly initialised tiny HF checkpoint of `preset` to `out_dir` and return it.

    Deterministic for a given preset, seed and overrides. Written to a temporary sibling and
    renamed, so a crash never leaves a half-written checkpoint that a later run would trust.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"model.preset={preset!r} is not a preset; choose one of {sorted(PRESETS)}")
    out = Path(out_dir)
    cfg_dict = {**PRESETS[preset], **overrides}
    marker = out / "megarl_tiny.json"
    if marker.exists() and json.loads(marker.read_text()) == {"seed": seed, "config": cfg_dict}:
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
    config.architectures = cfg_dict["architectures"]
    with torch.random.fork_rng():  # seeded init without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float().eval()
        if preset in ARCH_PRESETS:  # tiny-qwen3-moe keeps its init: the reference curve depends on it
            perturb_constant_tensors(model, torch.Generator().manual_seed(seed + 1))
    model.save_pretrained(tmp, safe_serialization=True)
    build_tokenizer(tools=preset == TOOLS_PRESET).save_pretrained(tmp)
    (tmp / "megarl_tiny.json").write_text(json.dumps({"seed": seed, "config": cfg_dict}))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
