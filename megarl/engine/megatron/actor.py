"""MegatronActor: one SPMD rank of the policy, with its reference policy colocated.

The actor and reference engines share the rank's Megatron mesh; the reference is forward-only
and never updated (verl's ActorRolloutRef arrangement, minus the rollout, which lives in HTTP
servers). Every method is called on all ranks by the worker group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from megarl.algo.corrections import mismatch_metrics, parity_stats, rollout_is_weights, version_span_metrics
from megarl.algo.kl import kl_penalty
from megarl.algo.losses import PolicyLossConfig, agg_loss, get_policy_loss, masked_mean
from megarl.algo.sequence_losses import SEQUENCE_LOSSES, SequenceLoss, SequenceLossConfig
from megarl.bridge.spec import BridgeSpec
from megarl.config.schema import OffloadConfig
from megarl.controller.decorator import register
from megarl.controller.dispatch import Dispatch, MeshCoord
from megarl.controller.worker import Worker
from megarl.data.batch import Batch
from megarl.engine.megatron.engine import EngineSpec, MegatronEngine, mean_metrics
from megarl.engine.megatron.offload import memory_metrics
from megarl.engine.megatron.offload_policy import OffloadPolicy
from megarl.engine.megatron.sequence_update import WEIGHTS, group_mini_batches, micro_batch_loss, row_weights


@dataclass
class ActorLossSpec:
    # what update_actor minimises: "policy" (actor_loss: the RL policy loss below) or "sft" (sft_loss:
    # the token-mean negative log-likelihood of the rows' response_mask tokens; `megarl sft`)
    objective: str = "policy"
    # a name registered in megarl/algo/losses.py, or a sequence loss (algo/sequence_losses.py)
    policy_loss: str = "vanilla"
    policy: PolicyLossConfig = dataclasses.field(default_factory=PolicyLossConfig)
    sequence: SequenceLossConfig = dataclasses.field(default_factory=SequenceLossConfig)
    rollout_is_level: str | None = None  # token | sequence | None (off): megarl/algo/corrections.py
    rollout_is_threshold: float = 2.0
    loss_agg_mode: str = "token-mean"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0


def actor_loss(spec: ActorLossSpec, log_prob, entropy, mb: Batch):
    """(loss summed over units, units, metrics) for one micro-batch; see engine.LossFn.

    Units are tokens for token-mean and sequences otherwise; Megatron divides the summed
    gradient by the units of the whole mini-batch (all micro-batches, all data-parallel ranks).
    A sequence loss counts its own units (sequence_update.py).
    """
    if spec.policy_loss in SEQUENCE_LOSSES:
        return _sequence_loss(spec, log_prob, entropy, mb)
    mask = mb["response_mask"].to(log_prob.dtype)
    units = mask.sum() if spec.loss_agg_mode == "token-mean" else torch.tensor(float(len(mb)))
    weights, extra = None, {}
    if "rollout_log_probs" in mb:  # the rollout engine's log-probs: the mismatch is always logged
        old, rollout = mb["old_log_probs"], mb["rollout_log_probs"].to(log_prob.dtype)
        extra.update(mismatch_metrics(old, rollout, mask))
        if "rollout_versions" in mb:  # each token's behaviour version (-1 unknown): the span per row
            extra.update(version_span_metrics(mb["rollout_versions"], mask))
        if spec.rollout_is_level is not None:
            weights, is_metrics = rollout_is_weights(
                old, rollout, mask, spec.rollout_is_level, spec.rollout_is_threshold
            )
            extra.update(is_metrics)
    elif spec.rollout_is_level is not None:
        raise ValueError("actor.rollout_is is on but the update batch has no rollout_log_probs")
    pg, pg_metrics = get_policy_loss(spec.policy_loss)(
        log_prob,
        mb["old_log_probs"],
        mb["advantages"],
        mask,
        spec.policy,
        loss_agg_mode=spec.loss_agg_mode,
        global_denominator=1.0,
        weights=weights,
    )
    loss = pg
    metrics = {
        "actor/pg_clipfrac": float(pg_metrics["pg_clipfrac"]),
        "actor/ppo_kl": float(pg_metrics["ppo_kl"]),
        "actor/entropy": float(masked_mean(entropy.detach(), mask)),
        **{f"actor/{k}": float(v) for k, v in pg_metrics.items() if k not in ("pg_loss", "pg_clipfrac", "ppo_kl")},
        **{k: float(v) for k, v in extra.items()},
    }
    if spec.entropy_coeff:
        loss = loss - spec.entropy_coeff * agg_loss(entropy, mask, spec.loss_agg_mode, 1.0)
    if spec.use_kl_loss:
        kl = kl_penalty(log_prob, mb["ref_log_probs"], spec.kl_loss_type)
        loss = loss + spec.kl_loss_coef * agg_loss(kl, mask, spec.loss_agg_mode, 1.0)
        metrics["actor/kl_loss"] = float(masked_mean(kl.detach(), mask))
    metrics["actor/pg_loss"] = float(pg.detach()) / max(float(units), 1.0)
    return loss, units, metrics


def _sequence_loss(spec: ActorLossSpec, log_prob, entropy, mb: Batch):
    loss = SEQUENCE_LOSSES[spec.policy_loss]
    value, units, metrics = micro_batch_loss(loss, spec.sequence, log_prob, mb)
    mask = mb["response_mask"].to(log_prob.dtype)
    metrics = {**metrics, "actor/entropy": float(masked_mean(entropy.detach(), mask))}
    if not loss.coupled:  # a coupled loss's value comes with its row weights (update_actor)
        metrics["actor/pg_loss"] = float(value.detach()) / max(float(units), 1.0)
    if "rollout_log_probs" in mb:
        metrics.update(mismatch_metrics(mb["old_log_probs"], mb["rollout_log_probs"].to(log_prob.dtype), mask))
    return value, units, metrics


def sft_loss(spec: ActorLossSpec, log_prob, entropy, mb: Batch):
    """(negative log-likelihood summed over the loss tokens, loss tokens, metrics) for one
    micro-batch; see engine.LossFn. The loss tokens are response_mask's (data/sft.py: the assistant
    turns); Megatron divides the summed gradient by the tokens of the whole mini-batch, so the
    gradient is the token mean's over every micro-batch and data-parallel rank. The metrics are
    sums (sft/nll_sum, sft/loss_tokens) the driver divides into the exact token mean."""
    mask = mb["response_mask"].to(log_prob.dtype)
    nll = -(log_prob * mask).sum()
    return (
        nll,
        mask.sum(),
        {
            "sft/nll_sum": float(nll.detach()),
            "sft/loss_tokens": float(mask.sum()),
            "actor/entropy": float(masked_mean(entropy.detach(), mask)),
        },
    )


OBJECTIVES = {"policy": actor_loss, "sft": sft_loss}


def _first_mini_batch_checks(first: list[tuple], atol: float) -> dict:
    """parity/* sums (algo/corrections.parity_stats) and the entropy sums of the first mini-batch's rows."""
    lp, ent = (torch.cat([f[i] for f in first]) for i in (0, 1))
    mask = torch.cat([f[2]["response_mask"] for f in first]).to(lp.dtype)
    rollout = torch.cat([f[2]["rollout_log_probs"] for f in first]).to(lp.dtype)
    out = {f"parity/{k}": v for k, v in parity_stats(lp, rollout, mask, atol).items()}
    out.update({"parity/entropy_sum": float((ent * mask).sum()), "parity/entropy_tokens": float(mask.sum())})
    return out


class MegatronActor(Worker):
    def __init__(
        self,
        engine_spec: EngineSpec,
        loss_spec: ActorLossSpec,
        with_ref: bool = False,
        offload: OffloadConfig | None = None,
        ref_offload: bool = False,
        **dist,
    ):
        super().__init__(**dist)
        self.engine_spec = engine_spec
        self.loss_spec = loss_spec
        self.with_ref = with_ref
        self.offload_config = offload
        self.ref_offload = ref_offload
        self.actor = None
        self.ref = None
        # the actor's configured parts are off the device from the end of one step (after the
        # weight sync) to the next step's first call; the reference's weights between its calls
        self.actor_offload: OffloadPolicy | None = None
        self.ref_offload_policy: OffloadPolicy | None = None
        self._transport = None  # the weight bridge, kept across syncs
        self._sync_fault: tuple[str, float] | None = None  # inject_sync_fault: the next sync's
        self._update_fault: str | None = None  # inject_update_fault: the next update's
        self._transport_spec: BridgeSpec | None = None

    def init_distributed(self) -> None:
        super().init_distributed()
        self.actor = MegatronEngine(self.engine_spec)
        self.actor.initialize()
        self.actor_offload = OffloadPolicy(self.actor, self.offload_config)
        self.actor_offload.release()
        if self.with_ref and self.engine_spec.lora is None:
            # forward-only: nothing to recompute (Megatron recomputes only in training mode anyway)
            ref_spec = dataclasses.replace(self.engine_spec, optim=None, recompute="none")
            self.ref = MegatronEngine(ref_spec)
            self.ref.initialize()
            self.ref_offload_policy = OffloadPolicy(self.ref, OffloadConfig(params=self.ref_offload))
            self.ref_offload_policy.release()

    def get_mesh_coord(self) -> MeshCoord:
        return MeshCoord(**self.actor.mesh_coord())

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch, temperature: float = 1.0) -> Batch | None:
        """`old_log_probs` and `entropy` of the responses under the current policy."""
        with self.actor_offload.forward(release_after=False):  # the update comes next
            out = self.actor.compute_log_prob(batch, temperature)
        if out is None:
            return None
        return Batch({"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch, temperature: float = 1.0) -> Batch | None:
        if not self.with_ref:
            raise RuntimeError(
                "compute_ref_log_prob: this actor group was built without a reference policy (ref.enabled=false)"
            )
        if self.ref is None:  # LoRA: the reference is the frozen base, the actor with its adapters off
            from megarl.engine.megatron.lora import disabled

            with self.actor_offload.forward(release_after=False), disabled(self.actor.bare_chunks()):
                out = self.actor.compute_log_prob(batch, temperature, with_entropy=False)
            return None if out is None else Batch({"ref_log_probs": out["log_probs"]})
        with self.ref_offload_policy.forward():
            out = self.ref.compute_log_prob(batch, temperature, with_entropy=False)  # nothing reads it
        return None if out is None else Batch({"ref_log_probs": out["log_probs"]})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_actor(
        self,
        batch: Batch,
        mini_batch_size: int,
        epochs: int = 1,
        temperature: float = 1.0,
        seed: int = 0,
        parity_atol: float | None = None,
    ) -> dict:
        """PPO-style update: `epochs` passes over this rank's rows in shuffled mini-batches, each
        an optimizer step on the loss of loss_spec.objective (the policy loss, or SFT's: one
        mini-batch of the whole batch is one SFT step).

        `mini_batch_size` counts rows of the global batch; each data-parallel rank takes its
        share. Returns metrics averaged over mini-batches (from the dp-owner ranks).
        `parity_atol`: the batch's old_log_probs are the rollout's (actor.old_log_prob: rollout);
        the first mini-batch's forward, on the weights the rollout sampled with, is compared with
        them (parity/* sums, trainer/parity.py) and gives their entropy (rollout/entropy_*).
        """
        dp = self.get_mesh_coord().dp_size
        local_mini = max(1, mini_batch_size // dp)
        n_mini = max(1, math.ceil(len(batch) / local_mini))
        gen = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        collected: list[dict] = []
        # the entropy is a metric unless the loss uses it: then it needs no backward
        head = self.actor.logprob_head(temperature, entropy_grad=bool(self.loss_spec.entropy_coeff))
        first: list[tuple] = []  # the first mini-batch's (log_prob, entropy, micro-batch)

        fault, self._update_fault = self._update_fault, None  # inject_update_fault

        def loss(lp, ent, mb):
            if capture:
                first.append((lp.detach(), ent.detach(), mb))
            value, units, metrics = OBJECTIVES[self.loss_spec.objective](self.loss_spec, lp, ent, mb)
            if fault == "loss":
                value, metrics["actor/pg_loss"] = value * float("nan"), float("nan")
            return value, units, metrics

        capture = parity_atol is not None
        coupled = self._coupled_loss()  # whole groups per mini-batch, rows weighted first
        with self.actor_offload.update(keep_params=True), self._nan_gradient(fault == "grad"):
            for epoch in range(epochs):
                if coupled is not None:
                    minis = group_mini_batches(batch, n_mini, gen)
                else:
                    minis = batch[torch.randperm(len(batch), generator=gen)].chunk(n_mini)
                for k, mini in enumerate(minis):
                    extra = {}
                    if coupled is not None:  # the old log-probs are these weights' in the first
                        current = epoch == 0 and k == 0 and parity_atol is None
                        extra = self._weigh_rows(coupled, mini, temperature, current)
                    collected.append({**self.actor.train_mini_batch(mini, loss, temperature, head=head), **extra})
                    capture = False
            memory = memory_metrics(self.actor.model, self.actor.optimizer)  # all resident here
        metrics = mean_metrics(collected)
        if first:
            metrics.update(_first_mini_batch_checks(first, parity_atol))
        metrics.update(memory)
        metrics["actor/num_updates"] = float(len(collected))
        metrics["perf/update_s"] = time.perf_counter() - start
        metrics.update(self.actor_offload.metrics("actor"))
        if self.ref_offload_policy is not None:
            metrics.update(self.ref_offload_policy.metrics("ref"))
        return metrics

    def _coupled_loss(self) -> SequenceLoss | None:
        loss = SEQUENCE_LOSSES.get(self.loss_spec.policy_loss) if self.loss_spec.objective == "policy" else None
        return loss if loss is not None and loss.coupled else None

    def _weigh_rows(self, loss: SequenceLoss, mini: Batch, temperature: float, current: bool) -> dict:
        """mini[WEIGHTS]: each row's weight in a coupled loss at the current weights (from the step's
        old log-probs when `current`, else a forward pass); the loss's metrics."""
        if current:
            log_prob = mini["old_log_probs"]
        else:
            out = self.actor.compute_log_prob(mini, temperature, with_entropy=False)
            log_prob = None if out is None else out["log_probs"]
        if log_prob is None:  # not the last pipeline stage: it computes no loss
            mini[WEIGHTS] = torch.zeros(len(mini))
            return {}
        mini[WEIGHTS], metrics = row_weights(loss, self.loss_spec.sequence, log_prob, mini)
        return metrics

    @register(dispatch=Dispatch.RANK_ZERO)
    def refresh_ref(self) -> dict:
        """The reference takes the actor's current weights (ref.update_every: SPIN's previous round,
        SPPO's previous iterate). Both engines share the rank's layout: a parameter-wise copy."""
        if self.ref is None:
            raise RuntimeError("refresh_ref: this actor group has no reference engine of its own (ref.enabled / LoRA)")
        copied = 0
        with self.actor_offload.forward(release_after=False), self.ref_offload_policy.forward(), torch.no_grad():
            ours = [(n, p) for chunk in self.actor.bare_chunks() for n, p in chunk.named_parameters()]
            theirs = [(n, p) for chunk in self.ref.bare_chunks() for n, p in chunk.named_parameters()]
            if [n for n, _ in ours] != [n for n, _ in theirs]:
                raise RuntimeError("refresh_ref: the actor's and the reference's parameters differ")
            for (_, src), (_, dst) in zip(ours, theirs):
                dst.copy_(src)
                copied += dst.numel() * dst.element_size()
        return {"ref/refresh_bytes": float(copied)}

    @register(dispatch=Dispatch.RANK_ZERO)
    def sync_weights(self, spec: BridgeSpec, weight_version: str, server_urls: list[str] | None = None) -> dict:
        """Stream the current weights to the rollout engines (every rank takes part; which ranks
        send depends on the transport): to `server_urls` when given (a restarted engine), else to
        every engine of the spec. Returns rank 0's stats."""
        from megarl.bridge import make_transport

        # one transport per run: its groups, plan, buffers and connections are reused; engines come
        # and go without rebuilding it (what it kept for a restarted engine's URL is dropped)
        if not spec.same_transport(self._transport_spec):
            if self._transport is not None:
                self._transport.close()
            self._transport = make_transport(spec, self.rank, self.world_size, self.get_node_ip())
            self._transport_spec = spec
        with self.actor_offload.forward(), self._faulty_sync():  # the step is over: the actor leaves the device
            return self._transport.sync(
                self.actor.sync_source(),
                weight_version,
                server_urls or spec.server_urls,
                restarted=server_urls is not None,
            )

    @register(dispatch=Dispatch.RANK_ZERO)
    def inject_sync_fault(self, name_part: str, delta: float) -> str:
        """Diagnostics: the next sync sends the first parameter whose name contains `name_part`
        with `delta` added (every rank's shard), then the parameter is restored exactly: the
        engines get wrong weights, the trainer keeps its own. What the parity checks must catch
        (a bridge that corrupts a tensor in transit). Returns the parameter's name."""
        name = next((n for chunk in self.actor.model for n, _ in chunk.named_parameters() if name_part in n), None)
        if name is None:
            raise ValueError(f"inject_sync_fault: no parameter name contains {name_part!r}")
        self._sync_fault = (name, float(delta))
        return name

    @register(dispatch=Dispatch.RANK_ZERO)
    def inject_update_fault(self, kind: str, rank: int) -> None:
        """Diagnostics: in the next update, rank `rank`'s loss ("loss") or the gradient of its
        first parameter ("grad") is NaN; what the trainer's finiteness check must catch."""
        if kind not in ("loss", "grad"):
            raise ValueError(f"inject_update_fault: kind must be 'loss' or 'grad', got {kind!r}")
        self._update_fault = kind if self.rank == rank else None

    @contextlib.contextmanager
    def _nan_gradient(self, on: bool):
        if not on:
            yield
            return
        param = next(p for chunk in self.actor.model for p in chunk.parameters() if p.requires_grad)
        handle = param.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        try:
            yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def _faulty_sync(self):
        fault, self._sync_fault = self._sync_fault, None
        if fault is None:
            yield
            return
        param = dict(p for chunk in self.actor.model for p in chunk.named_parameters())[fault[0]]
        kept = param.detach().clone()
        with torch.no_grad():
            param.add_(fault[1])
        try:
            yield
        finally:
            with torch.no_grad():
                param.copy_(kept)

    @register(dispatch=Dispatch.RANK_ZERO)
    def save_checkpoint(self, path: str, ref_path: str | None = None) -> dict:
        """The policy's model, optimizer and RNG to `path` (every rank writes its own shards);
        returns the checkpoint's metadata. The reference policy is saved (to `ref_path`) only when
        it is refreshed from the actor (ref.update_every); else it never changes and is rebuilt
        from model.path."""
        with self.actor_offload.update():  # offloaded parts are saved from where they live now
            meta = self.actor.save_checkpoint(path)
        if ref_path is not None:
            with self.ref_offload_policy.forward():
                self.ref.save_checkpoint(ref_path)
        return meta

    @register(dispatch=Dispatch.RANK_ZERO)
    def load_checkpoint(self, path: str, load_optimizer: bool = True, ref_path: str | None = None) -> dict:
        """Restore the policy (and from `ref_path` a refreshed reference) from a checkpoint saved in
        any TP / PP / EP layout; returns what was restored (rank 0's view)."""
        with self.actor_offload.update():
            out = self.actor.load_checkpoint(path, load_optimizer)
        if ref_path is not None:
            with self.ref_offload_policy.forward():
                self.ref.load_checkpoint(ref_path, load_optimizer=False)
        return out

    @register(dispatch=Dispatch.RANK_ZERO)
    def export_lora(self, out_dir: str) -> dict:
        """The policy's LoRA adapters as a PEFT folder at `out_dir` (rank 0 writes), for the base at
        the engine's model path. Returns rank 0's summary."""
        from megarl.engine.megatron.lora_io import write_peft_folder

        with self.actor_offload.forward():
            spec = self.engine_spec
            return write_peft_folder(self.actor.bare_chunks(), spec.lora, spec.model_path, out_dir, self.rank == 0)

    @register(dispatch=Dispatch.RANK_ZERO)
    def device_peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s of this rank's device for `dtype` (megarl/perf/peak.py; measured on CPU)."""
        from megarl.perf.peak import device_peak_flops

        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return device_peak_flops(device, dtype)

    @register(dispatch=Dispatch.RANK_ZERO)
    def export_hf(self, out_dir: str, config_dir: str) -> dict:
        """The current policy as a Hugging Face folder at `out_dir` (safetensors shards, plus the
        config and tokenizer files of `config_dir`); rank 0 writes. Returns rank 0's summary."""
        from megarl.engine.megatron.hf_export import write_hf_folder

        with self.actor_offload.forward():
            return write_hf_folder(self.actor.export_weights(), out_dir, config_dir, write=self.rank == 0)
