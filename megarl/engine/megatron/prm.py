"""MegatronPRM: one SPMD rank of PRIME's implicit process reward model, a worker group of its own.

The PRM is a causal LM (the policy's checkpoint, or prm.model.path) with its own optimizer and
parallel layout, colocated with the actor ranks like the critic. `compute_prm_log_prob` gives
log pi_prm of every response token (the trainer turns them into token rewards with the reference's,
algo/prime.py); `update_prm` fits the sequence-level implicit reward beta * log(pi_prm / pi_ref)
to the outcome labels with the prime_ce loss (algo/sequence_losses.py). Every method is called on
all ranks by the worker group.
"""

from __future__ import annotations

import math
import time

import torch

from megarl.algo.sequence_losses import SequenceLossConfig, get_sequence_loss
from megarl.config.schema import OffloadConfig
from megarl.controller.decorator import register
from megarl.controller.dispatch import Dispatch
from megarl.data.batch import Batch
from megarl.engine.megatron.engine import EngineSpec, mean_metrics
from megarl.engine.megatron.engine_worker import EngineWorker
from megarl.engine.megatron.sequence_update import micro_batch_loss


class MegatronPRM(EngineWorker):
    def __init__(
        self, engine_spec: EngineSpec, loss_cfg: SequenceLossConfig, offload: OffloadConfig | None = None, **dist
    ):
        super().__init__(engine_spec, offload, **dist)
        if engine_spec.optim is None or engine_spec.value_head:
            raise ValueError("MegatronPRM needs an EngineSpec with an optimizer and the language-model head")
        self.loss_cfg = loss_cfg

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_prm_log_prob(self, batch: Batch, temperature: float = 1.0) -> Batch | None:
        """`prm_log_probs` [B, R]: log pi_prm of each response token."""
        with self.offload.forward():
            out = self.engine.compute_log_prob(batch, temperature, with_entropy=False)
        return None if out is None else Batch({"prm_log_probs": out["log_probs"]})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_prm(
        self, batch: Batch, mini_batch_size: int, epochs: int = 1, temperature: float = 1.0, seed: int = 0
    ) -> dict:
        """`epochs` passes over this rank's rows in shuffled mini-batches of the prime_ce loss.
        Needs `ref_log_probs` [B, R] and `prm_labels` [B]. `mini_batch_size` counts rows of the
        global batch; each data-parallel rank takes its share."""
        loss = get_sequence_loss("prime_ce")
        dp = self.get_mesh_coord().dp_size
        n_mini = max(1, math.ceil(len(batch) / max(1, mini_batch_size // dp)))
        gen = torch.Generator().manual_seed(seed)
        head = self.engine.logprob_head(temperature, with_entropy=False)
        start, collected = time.perf_counter(), []

        def prm_loss(log_prob, mb):
            value, units, metrics = micro_batch_loss(loss, self.loss_cfg, log_prob, mb)
            return value, units, {**metrics, "prm/loss": float(value.detach()) / max(float(units), 1.0)}

        with self.offload.update():
            for _ in range(epochs):
                for mini in batch[torch.randperm(len(batch), generator=gen)].chunk(n_mini):
                    collected.append(self.engine.train_mini_batch(mini, prm_loss, temperature, head=head, prefix="prm"))
        metrics = mean_metrics(collected)
        metrics["prm/num_updates"] = float(len(collected))
        metrics["perf/prm_update_s"] = time.perf_counter() - start
        metrics.update(self.offload.metrics("prm"))
        return metrics
