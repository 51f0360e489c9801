"""A Megatron-core engine for one SPMD rank: build, load, forward log-probs, train, export.

Ray-free: the caller has already joined a torch.distributed group (gloo on CPU, NCCL on GPU).
`MegatronActor` (a Ray worker) and the tests drive it the same way.

Row layout it consumes (one row per sample, right-padded, no left padding, so a causal mask
is the whole attention mask): `input_ids` [B, T] = prompt tokens followed by response tokens,
`prompt_lengths` [B], `responses` [B, R], `response_mask` [B, R]. Outputs are [B, R] aligned with
`responses`: position j of row i is the log-prob of responses[i, j].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megarl.config.schema import OptimConfig, ParallelConfig
from megarl.data.batch import Batch
from megarl.engine.megatron import cpu_compat
from megarl.engine.megatron.context_parallel import gather_from_cp, split_for_cp
from megarl.engine.megatron.logprob import vocab_parallel_logprob_entropy
from megarl.engine.megatron.model import make_bridge
from megarl.engine.megatron.offload import PARTS, HostCopy, offload_groups
from megarl.engine.megatron import value_head as vh
from megarl.engine.megatron.weights import (export_hf_weights, export_owned_hf_weights, load_hf_weights,
                                            sends_owned_weights)


@dataclass
class EngineSpec:
    model_path: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # validated (SP resolved)
    optim: OptimConfig | None = None  # None: forward-only (reference policy)
    micro_batch_size: int = 8
    seed: int = 0
    moe_dispatcher: str = "alltoall"  # actor.moe.dispatcher
    value_head: bool = False  # a critic: scalar value head instead of the vocab output (value_head.py)


# A head maps the last stage's model output on this rank (logits [b, s, V/tp], or values) and the
# local labels [b, s] to per-position tensors [b, s]: (log_prob, entropy) for the policy.
Head = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
# A loss function maps the head's tensors aligned with the responses ([b, R] each) and the
# micro-batch to (loss summed over its units, number of units, metrics). Megatron divides the
# summed gradient by the units of the whole mini-batch across data-parallel ranks
# (calculate_per_token_loss).
LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, dict]]


class MegatronEngine:
    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.model = None
        self.optimizer = None
        self._offloaded: dict[str, HostCopy] = {}

    # ---------------------------------------------------------------- set-up
    def initialize(self) -> None:
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        if not dist.is_initialized():
            raise RuntimeError("MegatronEngine.initialize: join torch.distributed first")
        cpu_compat.activate()
        p = self.spec.parallel
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=p.tp,
                pipeline_model_parallel_size=p.pp,
                context_parallel_size=p.cp,
                expert_model_parallel_size=p.ep,
                expert_tensor_parallel_size=p.etp,
            )
        cpu_compat.seed_model_parallel(self.spec.seed)
        hf_config = AutoConfig.from_pretrained(self.spec.model_path)
        if self.spec.value_head:
            vh.untie_embeddings(hf_config)
        training = self.spec.optim is not None
        self.bridge = make_bridge(
            hf_config,
            sequence_parallel=bool(p.sequence_parallel),
            calculate_per_token_loss=True,
            expert_tensor_parallel_size=p.etp,
            moe_token_dispatcher_type=self.spec.moe_dispatcher,
            # Megatron's allgather dispatcher refuses variable sequence lengths; every micro-batch of
            # one call is padded to the same length here, so the pipeline's shapes are fixed anyway
            **({"variable_seq_lengths": False} if self.spec.moe_dispatcher == "allgather" else {}),
        )
        model = self.bridge._model_provider(vh.value_model_callbacks() if self.spec.value_head else [])(
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()
        )
        if self.spec.value_head:  # the head is not in the checkpoint
            load_hf_weights(self.bridge, model, self.spec.model_path, skip_prefix=vh.VALUE_HEAD_PREFIX)
            vh.init_value_head(model, self.spec.seed, self.bridge.config.init_method_std)
        else:
            load_hf_weights(self.bridge, model, self.spec.model_path)
        if training:
            model = self._wrap_ddp(model)
            self.optimizer = self._build_optimizer(model)
        else:
            for param in model.parameters():
                param.requires_grad_(False)
        self.model = model
        self.config = self.bridge.config

    def _wrap_ddp(self, model):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.spec.optim.use_distributed_optimizer,
            average_in_collective=False,
        )
        ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.no_sync_func = ddp.no_sync
        return ddp

    def _build_optimizer(self, model):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.spec.optim
        config = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=False,
            fp16=False,
            params_dtype=torch.float32,
            use_distributed_optimizer=o.use_distributed_optimizer,
        )
        return get_megatron_optimizer(config, [model])

    # ---------------------------------------------------------------- mesh facts
    def mesh_coord(self) -> dict:
        from megatron.core import parallel_state as ps

        return dict(
            rank=dist.get_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
        )

    # ---------------------------------------------------------------- forward / backward
    def _padded_length(self, length: int) -> int:
        # sequence parallel scatters the sequence over TP ranks: it must divide evenly; context
        # parallel cuts it into 2*cp chunks first (context_parallel.py), then SP splits a rank's part.
        p = self.spec.parallel
        multiple = p.tp if p.sequence_parallel else 1
        if p.cp > 1:
            multiple *= 2 * p.cp
        return int(math.ceil(length / multiple) * multiple)

    def _micro_batches(self, batch: Batch) -> list[Batch]:
        n = max(1, math.ceil(len(batch) / self.spec.micro_batch_size))
        return batch.chunk(n)

    def logprob_head(self, temperature: float) -> Head:
        """The policy head: vocab-parallel logits -> (log p(label), entropy) per position."""
        from megatron.core import parallel_state as ps

        tp_group = ps.get_tensor_model_parallel_group()

        def head(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            vocab_start = ps.get_tensor_model_parallel_rank() * logits.shape[-1]
            return vocab_parallel_logprob_entropy(logits, labels, vocab_start, tp_group, temperature)

        return head

    def _run(self, batch: Batch, loss_fn: LossFn | None, head: Head, forward_only: bool):
        """One pass of megatron's pipeline schedule over `batch` split into micro-batches.

        `head` turns the model's output into per-position tensors; the engine aligns them with the
        responses ([b, R] each) and hands them to `loss_fn`. Returns, on the last pipeline stage,
        the per-micro-batch (tuple of [b, R] tensors, metrics); on other stages an empty list.
        """
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cpu_compat.activate()
        micro = self._micro_batches(batch)
        seq_len = self._padded_length(max(mb["input_ids"].shape[1] for mb in micro))
        cp_group = ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None
        cp_rank = ps.get_context_parallel_rank()
        results = []

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            ids = mb["input_ids"]
            if ids.shape[1] < seq_len:
                ids = torch.nn.functional.pad(ids, (0, seq_len - ids.shape[1]), value=0)
            position_ids = torch.arange(seq_len).unsqueeze(0).expand_as(ids)
            # labels[t] = ids[t+1]: shifted on the full sequence, BEFORE the CP split, so a rank's
            # last local token still gets its label from the next chunk (which another rank holds)
            labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=0)
            output = model(split_for_cp(ids, cp_group), split_for_cp(position_ids, cp_group), None)
            local_labels = split_for_cp(labels, cp_group)

            def loss_func(output):
                # Under CP every rank assembles the full sequence and computes the same loss on it;
                # the gather's backward keeps only this rank's tokens, so each token's gradient
                # flows once (context_parallel._GatherSeq). The last position has no label.
                per_token = tuple(_response_slice(gather_from_cp(v, cp_group)[:, :-1], mb)
                                  for v in head(output, local_labels))
                detached = tuple(v.detach() for v in per_token)
                if loss_fn is None:
                    results.append((detached, {}))
                    zero = per_token[0].sum() * 0
                    return zero, torch.ones((), dtype=torch.int), {}
                loss_sum, units, metrics = loss_fn(*per_token, mb)
                results.append((detached, metrics))
                # Megatron sums the units over DP x CP (finalize_model_grads); every CP rank holds
                # the same full-sequence loss, so only CP rank 0 reports them, as with CP=1.
                units = units.to(torch.int) if cp_rank == 0 else torch.zeros((), dtype=torch.int)
                return loss_sum, units, {}

            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[self.model],
            num_microbatches=len(micro),
            seq_length=seq_len,
            micro_batch_size=max(len(mb) for mb in micro),
            forward_only=forward_only,
        )
        return results

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch, temperature: float = 1.0) -> Batch | None:
        """log-probs and entropy of `responses` under the current weights ([B, R] each)."""
        self.model.eval()
        results = self._run(batch, None, self.logprob_head(temperature), forward_only=True)
        if not results:
            return None
        return Batch({
            "log_probs": torch.cat([r[0][0] for r in results]),
            "entropy": torch.cat([r[0][1] for r in results]),
        })

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch | None:
        """The value model's estimate at each position that predicts a response token ([B, R])."""
        self.model.eval()
        results = self._run(batch, None, vh.value_head, forward_only=True)
        if not results:
            return None
        return Batch({"values": torch.cat([r[0][0] for r in results])})

    def train_mini_batch(self, batch: Batch, loss_fn: LossFn, temperature: float = 1.0,
                         head: Head | None = None, prefix: str = "actor") -> dict:
        """One optimizer step over `batch` (this rank's share of a mini-batch); `head` defaults to
        the policy's log-prob head, so loss_fn receives (log_prob, entropy, micro-batch)."""
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        results = self._run(batch, loss_fn, head or self.logprob_head(temperature), forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        metrics = mean_metrics([r[1] for r in results])
        metrics[f"{prefix}/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics[f"{prefix}/update_skipped"] = float(not ok)
        return metrics

    # ---------------------------------------------------------------- offload (colocation)
    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> int:
        """Move the chosen parts to host memory and free their device storage (offload.py).

        Parts already offloaded, and parts without tensors (grads / optimizer of a forward-only
        engine, Adam's moments before the first step) are skipped. Returns the bytes moved.
        """
        groups = offload_groups(self.model, self.optimizer)
        moved = 0
        for part, wanted in zip(PARTS, (params, grads, optimizer)):
            if wanted and part not in self._offloaded and groups[part]:
                self._offloaded[part] = HostCopy(groups[part])
                moved += self._offloaded[part].nbytes
        return moved

    def onload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Bring back (bit for bit) the chosen parts that are offloaded."""
        for part, wanted in zip(PARTS, (params, grads, optimizer)):
            if wanted and part in self._offloaded:
                self._offloaded.pop(part).restore()

    def offloaded(self) -> set[str]:
        return set(self._offloaded)

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full tensor) for every weight; a collective: call it on every rank."""
        return export_hf_weights(self.bridge, self._bare_model())

    def export_owned_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What this rank sends in the distributed transport (weights.export_owned_hf_weights)."""
        return export_owned_hf_weights(self.bridge, self._bare_model())

    def sends_owned_weights(self) -> bool:
        return sends_owned_weights(self._bare_model())

    def local_pieces(self) -> list:
        """The HF boxes this rank produces from its own shards (shards.local_hf_pieces)."""
        from megarl.engine.megatron.shards import local_hf_pieces

        return local_hf_pieces(self.bridge, self._bare_model())

    def _bare_model(self):
        from megatron.core.distributed import DistributedDataParallel

        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model


def _response_slice(values: torch.Tensor, mb: Batch) -> torch.Tensor:
    """Pick, per row, the positions that predict response tokens: [b, T-1] -> [b, R].

    values[:, t] scores token t+1, so response token j (at t+1 = prompt_len + j) is values[:,
    prompt_len - 1 + j]. Positions past the row's response are zeroed by response_mask.
    """
    R = mb["responses"].shape[1]
    start = mb["prompt_lengths"].long() - 1
    index = (start.unsqueeze(1) + torch.arange(R).unsqueeze(0)).clamp(max=values.shape[1] - 1)
    return values.gather(1, index) * mb["response_mask"].to(values.dtype)


def mean_metrics(dicts: list[dict]) -> dict:
    """Per key, the mean over the dicts that have it."""
    keys = {k for d in dicts for k in d}
    return {k: sum(float(d[k]) for d in dicts if k in d) / sum(k in d for d in dicts) for k in keys}
