"""The engine's model built on the meta device: every parameter's names, shapes and sharded keys, no storage.

The converter builds the same MegatronEngine (mbridge bridge, local spec, TP = PP = EP = 1) the
trainer uses, inside `torch.device("meta")`: megatron-core 0.19.2 with `use_cpu_initialization`
builds and "initialises" it there without allocating, so `sharded_state_dict()` gives every
torch_dist key, global shape and offset (layer / expert axes included) for free. Tensors are then
made real one parameter (hf-to-mcore) or one chunk of parameters (mcore-to-hf) at a time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megarl.engine.megatron.weights import local_to_global_names


class Param(NamedTuple):
    global_name: str  # mbridge's name (model-wide layer index, grouped-expert form)
    local_name: str  # the key in the model's state dict and sharded state dict
    tensor: torch.Tensor  # on meta

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class MetaModel:
    def __init__(self, model_path: str):
        from megarl.engine.megatron.cpu import compat as cpu_compat
        from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

        self.engine = MegatronEngine(EngineSpec(model_path=model_path, optim=None, load_hf=False))
        # cpu_compat's function mode stays entered for good; entered inside the meta device context
        # it keeps that context alive after the `with` (every later tensor would be on meta)
        cpu_compat.activate()
        with torch.device("meta"):
            self.engine.initialize()
        self.bridge = self.engine.bridge
        (model,) = self.engine.bare_chunks()
        state = model.state_dict(keep_vars=True)
        self.params = [Param(g, local, state[local]) for local, g in local_to_global_names(model).items()]
        self._by_storage = {_storage(p.tensor): p for p in self.params}

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def owner(self, view: torch.Tensor) -> Param:
        """The parameter a sharded tensor's (meta) data is a view of: megatron's factories (gated
        MLP halves) slice parameters, so several sharded tensors share one parameter's storage."""
        return self._by_storage[_storage(view)]

    def sharded_state_dict(self, is_loading: bool) -> dict:
        """{"model": {"chunk0": ...}}: the nesting MegatronEngine's checkpoints use."""
        from megarl.engine.megatron import checkpoint

        return checkpoint._sharded_state_dict(self.engine, False, rng=False, is_loading=is_loading)

    def chunks(self, max_bytes: int) -> list[list[Param]]:
        """Consecutive parameters (model order) in groups of at most `max_bytes`; a larger
        parameter is a group of its own."""
        groups, size = [[]], 0
        for p in self.params:
            if groups[-1] and size + p.nbytes > max_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.nbytes
        return [g for g in groups if g]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata
