"""EngineWorker: a worker rank that holds one trainable Megatron engine and its offload policy.

The critic (critic.py) and PRIME's implicit PRM (prm.py) are each one: a worker group of their
own, colocated with the actor ranks, with their own layout and optimizer, checkpointed with the
run. Subclasses add their passes (compute_*, update_*); every method is called on all ranks by
the worker group.
"""

from __future__ import annotations

from megarl.config.schema import OffloadConfig
from megarl.controller.decorator import register
from megarl.controller.dispatch import Dispatch, MeshCoord
from megarl.controller.worker import Worker
from megarl.engine.megatron.engine import EngineSpec, MegatronEngine
from megarl.engine.megatron.offload_policy import OffloadPolicy


class EngineWorker(Worker):
    def __init__(self, engine_spec: EngineSpec, offload: OffloadConfig | None = None, **dist):
        super().__init__(**dist)
        self.engine_spec = engine_spec
        self.offload_config = offload
        self.engine: MegatronEngine | None = None
        self.offload: OffloadPolicy | None = None

    def init_distributed(self) -> None:
        super().init_distributed()
        self.engine = MegatronEngine(self.engine_spec)
        self.engine.initialize()
        self.offload = OffloadPolicy(self.engine, self.offload_config)
        self.offload.release()

    def get_mesh_coord(self) -> MeshCoord:
        return MeshCoord(**self.engine.mesh_coord())

    @register(dispatch=Dispatch.RANK_ZERO)
    def save_checkpoint(self, path: str) -> dict:
        """The engine's model (with its head), optimizer and RNG to `path`; rank 0's metadata."""
        with self.offload.update():
            return self.engine.save_checkpoint(path)

    @register(dispatch=Dispatch.RANK_ZERO)
    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> dict:
        with self.offload.update():
            return self.engine.load_checkpoint(path, load_optimizer)
