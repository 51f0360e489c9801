"""make_trainer: the loop a run's trainer.mode names, over the runtime start_runtime built.

sync          SyncTrainer: generate, then train, then sync, one step after another
one_step_off  OneStepOffTrainer: step k+1's rollout runs while step k trains
fully_async   FullyAsyncTrainer: a producer keeps generating (partial rollouts across syncs)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megarl.trainer.metrics import MetricsLogger
    from megarl.trainer.runtime import Runtime
    from megarl.trainer.sync_trainer import SyncTrainer


def make_trainer(runtime: Runtime, logger: MetricsLogger, resume: tuple | None = None) -> SyncTrainer:
    from megarl.trainer.async_trainer import FullyAsyncTrainer, OneStepOffTrainer
    from megarl.trainer.sync_trainer import SyncTrainer

    loops = {"sync": SyncTrainer, "one_step_off": OneStepOffTrainer, "fully_async": FullyAsyncTrainer}
    return loops[runtime.cfg.trainer.mode](runtime, logger, resume=resume)
