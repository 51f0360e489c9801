"""LoRA adapters on the embedded engine, through SGLang's adapter endpoints.

SGLang keeps its base weights and applies an adapter per request (`lora_path` names it). This
engine serves one model: loading an adapter merges it into the weights it adapts,
W = W_base + (alpha / r) * B @ A, computed in fp32 and cast to the weight's dtype (the trainer's
arithmetic, engine/megatron/lora.py, so the merged weights are the trainer's bit for bit), and
written through the engine's ordinary weight update (all or nothing, every TP rank its slice).
The adapted base weights are read once from the model's checkpoint and kept, so a new adapter
replaces the previous one instead of stacking on it; unloading writes them back.

One adapter at a time: a request may name it (`lora_path`) or nothing (it gets the merged model,
where SGLang would give the base); naming another adapter is refused.
"""

from __future__ import annotations

import torch

from megarl.rollout.engine.protocol import InvalidRequest

PEFT_PREFIX = "base_model.model."


def peft_modules(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF module: (A, B)} of PEFT-named adapter tensors (`...q_proj.lora_A.weight`)."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        body = key.removeprefix(PEFT_PREFIX)
        for factor in ("A", "B"):
            suffix = f".lora_{factor}.weight"
            if body.endswith(suffix):
                found.setdefault(body.removesuffix(suffix), {})[factor] = tensor
                break
        else:
            raise ValueError(f"adapter tensor {key!r} is not a LoRA factor (…lora_A.weight / …lora_B.weight)")
    incomplete = sorted(m for m, f in found.items() if set(f) != {"A", "B"})
    if incomplete:
        raise ValueError(f"adapter modules without both lora_A and lora_B: {incomplete[:5]}")
    return {m: (f["A"], f["B"]) for m, f in found.items()}


class EngineLora:
    # set by GenerationEngine.__init__: model_path, _tensors_by_name, _rename; update_weights from EngineWeights

    lora_adapter: str | None = None  # the adapter merged into the weights now
    _lora_base: dict[str, torch.Tensor] | None = None  # HF name -> the base weight it replaced

    def load_lora_adapter_from_tensors(
        self, lora_name: str, config: dict, tensors: dict[str, torch.Tensor], weight_version: str | None = None
    ) -> str:
        """Merge the PEFT adapter `tensors` (config: its adapter_config.json) into the weights."""
        if config.get("use_rslora") or config.get("use_dora"):
            raise ValueError("rsLoRA and DoRA adapters are not merged by this engine")
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        modules = peft_modules(tensors)
        base = self._base_weights([f"{m}.weight" for m in modules])
        merged = []
        for module, (a, b) in modules.items():
            w = base[f"{module}.weight"]
            if tuple(b.shape[:1]) + tuple(a.shape[1:]) != tuple(w.shape) or a.shape[0] != b.shape[1]:
                raise ValueError(
                    f"adapter {module}: A {list(a.shape)} and B {list(b.shape)} do not fit {list(w.shape)}"
                )
            delta = (alpha / rank) * b.float() @ a.float()
            merged.append((f"{module}.weight", (w.float() + delta).to(w.dtype)))
        # modules the previous adapter changed and this one does not go back to the base
        merged += [(name, w) for name, w in (self._lora_base or {}).items() if name[: -len(".weight")] not in modules]
        message = self.update_weights(merged, weight_version)
        self.lora_adapter = lora_name
        return f"loaded LoRA adapter {lora_name!r} ({len(modules)} modules merged); {message}"

    def unload_lora_adapter(self, lora_name: str, weight_version: str | None = None) -> str:
        if lora_name != self.lora_adapter:
            raise ValueError(f"LoRA adapter {lora_name!r} is not loaded (loaded: {self.lora_adapter!r})")
        message = self.update_weights(list((self._lora_base or {}).items()), weight_version)
        self.lora_adapter = None
        return f"unloaded LoRA adapter {lora_name!r}; {message}"

    def check_lora_path(self, lora_path) -> None:
        """A request's `lora_path` (one name, or one per prompt) names the loaded adapter or nothing."""
        names = lora_path if isinstance(lora_path, list) else [lora_path]
        for name in names:
            if name is not None and not isinstance(name, str):
                raise InvalidRequest(f"lora_path={lora_path!r} must be an adapter's name, null, or a list of those")
            if name is not None and name != self.lora_adapter:
                loaded = f"the loaded one is {self.lora_adapter!r}" if self.lora_adapter else "none is loaded"
                raise InvalidRequest(f"lora_path={name!r}: no such LoRA adapter on this engine ({loaded})")

    def _base_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The base values of `names`, read from the model's checkpoint the first time each is needed."""
        from megarl.rollout.engine.weights import read_checkpoint_tensors

        self._lora_base = dict(self._lora_base or {})
        missing = [n for n in names if n not in self._lora_base]
        own = self._rename or (lambda name: name)  # checkpoint names -> the model's (hf_names.py)
        unknown = [n for n in missing if own(n) not in self._tensors_by_name]
        if unknown:
            raise ValueError(f"the adapter targets modules this model does not have: {unknown[:5]}")
        if missing:  # in the engine's dtype, as the trainer holds them (a bf16 engine of an fp32 file)
            read = read_checkpoint_tensors(self.model_path, missing, self._rename)
            self._lora_base.update({n: t.to(self._tensors_by_name[own(n)].dtype) for n, t in read.items()})
        return self._lora_base
