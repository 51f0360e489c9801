"""A LoRA checkpoint (its adapters and the name of its base, engine/megatron/checkpoint.py) as a
Hugging Face folder: the base with the adapters merged in, and the adapters alone as a PEFT folder
in its `lora/` subfolder. The base's weights are read from where the checkpoint names it (or from
--hf-config), the adapters from the checkpoint; a one-rank engine merges them."""

from __future__ import annotations

import os

from checkpoint_convert import ConvertError

PEFT_SUBDIR = "lora"


def lora_to_hf(mcore: str, out: str, meta: dict, hf_config: str | None, overwrite: bool) -> dict:
    from checkpoint_convert.convert import one_rank, staged
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine
    from megarl.engine.megatron.hf_export import write_hf_folder
    from megarl.engine.megatron.lora import LoraSpec
    from megarl.engine.megatron.lora_io import write_peft_folder

    lora = meta["lora"]
    base = (os.path.dirname(hf_config) if hf_config.endswith(".json") else hf_config) if hf_config else lora["base"]
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise ConvertError(
            f"{mcore} holds LoRA adapters for the base model {lora['base']}, which is not there; pass the "
            "base's Hugging Face folder (--hf-config)"
        )
    spec = LoraSpec(rank=lora["rank"], alpha=lora["alpha"], target_modules=tuple(lora["target_modules"]))
    with staged(out, overwrite) as stage, one_rank():
        engine = MegatronEngine(EngineSpec(model_path=base, optim=None, lora=spec))
        engine.initialize()
        engine.load_checkpoint(mcore, load_optimizer=False)
        info = write_hf_folder(engine.export_weights(), stage, base, write=True)
        peft = write_peft_folder(engine.bare_chunks(), spec, base, os.path.join(stage, PEFT_SUBDIR), write=True)
    return dict(path=os.path.abspath(out), tensors=info["tensors"], config=base, adapter_bytes=peft["bytes"])
