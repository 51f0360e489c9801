"""MegatronCritic: one SPMD rank of the value function, a worker group of its own.

The critic is the policy's GPTModel with a scalar head (value_head.py), initialised from the
policy's checkpoint or its own, with its own optimizer and parallel layout. `compute_values` gives
the value at each position that predicts a response token (aligned like the log-probs);
`update_critic` fits them to `returns` with PPO's clipped value loss. Every method is called on
all ranks by the worker group.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from megarl.algo.losses import masked_mean, value_loss
from megarl.config.schema import OffloadConfig
from megarl.controller.decorator import register
from megarl.controller.dispatch import Dispatch
from megarl.data.batch import Batch
from megarl.engine.megatron.engine import EngineSpec, mean_metrics
from megarl.engine.megatron.engine_worker import EngineWorker


@dataclass
class CriticLossSpec:
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


def critic_loss(spec: CriticLossSpec, values: torch.Tensor, mb: Batch):
    """(loss summed over units, units, metrics) for one micro-batch; see engine.LossFn.

    `mb["values"]` holds the values the batch was collected with (the clipping anchor).
    """
    mask = mb["response_mask"].to(values.dtype)
    units = mask.sum() if spec.loss_agg_mode == "token-mean" else torch.tensor(float(len(mb)))
    loss, m = value_loss(
        values, mb["values"], mb["returns"], mask, spec.cliprange_value, spec.loss_agg_mode, global_denominator=1.0
    )
    metrics = {
        "critic/vf_loss": float(loss.detach()) / max(float(units), 1.0),
        "critic/vf_clipfrac": float(m["vf_clipfrac"]),
        "critic/vpred_mean": float(m["vpred_mean"]),
        "critic/returns_mean": float(masked_mean(mb["returns"], mask)),
    }
    return loss, units, metrics


class MegatronCritic(EngineWorker):
    def __init__(
        self, engine_spec: EngineSpec, loss_spec: CriticLossSpec, offload: OffloadConfig | None = None, **dist
    ):
        super().__init__(engine_spec, offload, **dist)
        if not engine_spec.value_head or engine_spec.optim is None:
            raise ValueError("MegatronCritic needs an EngineSpec with value_head=True and an optimizer")
        self.loss_spec = loss_spec

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> Batch | None:
        """`values` [B, R]: the critic's estimate at each position that predicts a response token."""
        with self.offload.forward():
            return self.engine.compute_values(batch)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_critic(self, batch: Batch, mini_batch_size: int, epochs: int = 1, seed: int = 0) -> dict:
        """`epochs` passes over this rank's rows in shuffled mini-batches of the clipped value loss.

        Needs `values` (from compute_values, the clipping anchor) and `returns` ([B, R] each).
        `mini_batch_size` counts rows of the global batch; each data-parallel rank takes its share.
        """
        dp = self.get_mesh_coord().dp_size
        n_mini = max(1, math.ceil(len(batch) / max(1, mini_batch_size // dp)))
        gen = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        collected: list[dict] = []
        with self.offload.update():
            for _ in range(epochs):
                shuffled = batch[torch.randperm(len(batch), generator=gen)]
                for mini in shuffled.chunk(n_mini):
                    collected.append(
                        self.engine.train_mini_batch(
                            mini,
                            lambda v, mb: critic_loss(self.loss_spec, v, mb),
                            head=self.value_head(),
                            prefix="critic",
                        )
                    )
        metrics = mean_metrics(collected)
        metrics["critic/num_updates"] = float(len(collected))
        metrics["perf/critic_update_s"] = time.perf_counter() - start
        metrics.update(self.offload.metrics("critic"))
        return metrics

    @staticmethod
    def value_head():
        from megarl.engine.megatron.value_head import value_head

        return value_head
