"""What a step's phases use of the loop that runs them (the Trainer, loop.py): phases.py and the
recipes' phases (spin.py, prime.py) take it as `loop`."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

import torch

from megarl.data.batch import Batch

if TYPE_CHECKING:
    from megarl.config.schema import RunConfig
    from megarl.trainer.parity import Probe
    from megarl.trainer.runtime import Runtime
    from megarl.trainer.sources import RolloutSource


class StepLoop(Protocol):
    """What the phases use of the loop that runs them (the Trainer, loop.py)."""

    rt: Runtime
    cfg: RunConfig
    release: bool  # colocated engines release their memory for the training phases
    dp_size: int
    weight_version: int
    actor_version: int
    actor_lock: threading.Lock
    # ref.update_every: the reference was refreshed from the actor after its last update, so it
    # holds the actor's weights; its log-probs are the actor's old ones (phases.old_ref_values)
    ref_is_actor: bool
    source: RolloutSource  # where the rows come from; it waits for or pauses generation at the sync

    def sync_weights(self) -> dict: ...
    def _token_lengths(self, rows: Batch) -> list[int]: ...
    def _trainer_view(self, rows: Batch, *extra: str) -> Batch: ...
    def _start_probe(self, rows: Batch) -> Probe | None: ...
    def _check_parity(self, rows: Batch, step: int, probe: Probe | None = None) -> dict: ...
    def _rewards(self, rows: Batch) -> tuple[torch.Tensor, dict]: ...
