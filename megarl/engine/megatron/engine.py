"""A Megatron-core engine for one SPMD rank: build, load, forward log-probs, train, export.

Ray-free: the caller has already joined a torch.distributed group (gloo on CPU, NCCL on GPU).
`MegatronActor` (a Ray worker) and the tests drive it the same way.

Row layout it consumes (one row per sample, right-padded, no left padding, so a causal mask
is the whole attention mask): `input_ids` [B, T] = prompt tokens followed by response tokens,
`prompt_lengths` [B], `responses` [B, R], `response_mask` [B, R]. Outputs are [B, R] aligned with
`responses`: position j of row i is the log-prob of responses[i, j].

`self.model` is a list of model chunks, one per virtual pipeline stage (parallel.vpp; a list of
one without it): Megatron's interleaved schedule, its optimizer and mbridge all take that list.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl.config.schema import OptimConfig, ParallelConfig
from megarl.config.validate import stage_layers
from megarl.data.batch import Batch
from megarl.engine.megatron import inputs as rows
from megarl.engine.megatron import mcore_fixes
from megarl.engine.megatron import value_head as vh
from megarl.engine.megatron.context_parallel import gather_from_cp, split_for_cp
from megarl.engine.megatron.cpu import compat as cpu_compat
from megarl.engine.megatron.grad_guard import grads_finite
from megarl.engine.megatron.lora import LoraSpec
from megarl.engine.megatron.model import make_bridge, pipeline_split_args, precision_dtype, recompute_args
from megarl.engine.megatron.offload import PARTS, HostCopy, offload_groups
from megarl.engine.megatron.optimizer import build_optimizer
from megarl.engine.megatron.output_head import PolicyHead
from megarl.engine.megatron.routing_replay import RoutingReplay
from megarl.engine.megatron.weights import (
    export_hf_weights,
    export_owned_hf_weights,
    load_hf_weights,
    sends_owned_weights,
)


@dataclass
class EngineSpec:
    model_path: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # validated (SP resolved)
    optim: OptimConfig | None = None  # None: forward-only (reference policy)
    micro_batch_size: int = 8
    seed: int = 0
    moe_dispatcher: str = "alltoall"  # actor.moe.dispatcher
    pack_sequences: bool = True  # THD packing inside the engine (packing.py); False: right-padded rows
    max_tokens_per_micro_batch: int | None = None  # micro-batches by token budget instead of rows
    value_head: bool = False  # a critic: scalar value head instead of the vocab output (value_head.py)
    # False: model_path needs only config.json; the weights stay as built until a checkpoint is
    # loaded into them (checkpoint_convert's mcore-to-hf has no Hugging Face weights to read)
    load_hf: bool = True
    precision: str = "fp32"  # actor.precision: fp32 | bf16 (model.precision_dtype)
    recompute: str = "none"  # actor/critic.recompute: none | selective | full (model.recompute_args)
    routing_replay: bool = False  # actor.moe.routing_replay: replay the rows' routed_experts (routing_replay.py)
    host_optimizer: float = 0.0  # actor.offload.host_optimizer: the share of Adam's state and step on the host
    logits_memory: str = "auto"  # actor.logits_memory: the log-prob head's logits kept for backward or made again
    lora: LoraSpec | None = None  # actor.lora: adapters on the targeted linears, the base frozen (lora.py)


# A head maps the last stage's model output on this rank and the local labels [b, s] to
# per-position tensors [b, s]: (log_prob, entropy) for the policy (output_head.PolicyHead, whose
# output_processor the model runs instead of its output layer), (values,) for the critic.
Head = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
# A loss function maps the head's tensors aligned with the responses ([b, R] each) and the micro-batch
# to (loss summed over its units, number of units, metrics). Megatron divides the summed gradient by
# the units of the whole mini-batch across data-parallel ranks (calculate_per_token_loss).
LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, dict]]


class MegatronEngine:
    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.model = None
        self.optimizer = None
        self.replay: RoutingReplay | None = None
        self._offloaded: dict[str, HostCopy] = {}

    # ---------------------------------------------------------------- set-up
    def initialize(self) -> None:
        cpu_compat.import_megatron()  # first: without torch.compile on CPU
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        if not dist.is_initialized():
            raise RuntimeError("MegatronEngine.initialize: join torch.distributed first")
        dtype = precision_dtype(self.spec.precision)  # a bad value fails before any work
        cpu_compat.activate()
        mcore_fixes.apply()
        p = self.spec.parallel
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=p.tp,
                pipeline_model_parallel_size=p.pp,
                context_parallel_size=p.cp,
                expert_model_parallel_size=p.ep,
                expert_tensor_parallel_size=p.etp,
                virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
            )
        cpu_compat.seed_model_parallel(self.spec.seed)
        hf_config = AutoConfig.from_pretrained(self.spec.model_path)
        stage_layers(p, hf_config.num_hidden_layers)  # ConfigError if the pipeline split does not exist
        if self.spec.value_head:
            vh.untie_embeddings(hf_config)
        training = self.spec.optim is not None
        self.bridge = make_bridge(
            hf_config,
            dtype=dtype,
            sequence_parallel=bool(p.sequence_parallel),
            calculate_per_token_loss=True,
            expert_tensor_parallel_size=p.etp,
            moe_token_dispatcher_type=self.spec.moe_dispatcher,
            **pipeline_split_args(p),
            **recompute_args(self.spec.recompute),
            # Megatron's allgather dispatcher refuses variable sequence lengths; every micro-batch of
            # one call is padded to the same length here, so the pipeline's shapes are fixed anyway
            **({"variable_seq_lengths": False} if self.spec.moe_dispatcher == "allgather" else {}),
        )
        chunks = self._build_chunks()
        if self.spec.value_head:  # the head is not in the checkpoint
            if self.spec.load_hf:
                load_hf_weights(self.bridge, chunks, self.spec.model_path, skip_prefix=vh.VALUE_HEAD_PREFIX)
            for chunk in chunks:
                vh.init_value_head(chunk, self.spec.seed, self.bridge.config.init_method_std)
        elif self.spec.load_hf:
            load_hf_weights(self.bridge, chunks, self.spec.model_path)
        rows.place(chunks, dtype)
        if self.spec.lora is not None:
            from megarl.engine.megatron import lora

            lora.attach(self.bridge, chunks, self.spec.lora, self.spec.seed)
        if training:
            chunks = self._wrap_ddp(chunks)
            self.optimizer = build_optimizer(
                self.spec.optim, self.bridge.config.params_dtype, chunks, self.spec.host_optimizer
            )
        else:
            for chunk in chunks:
                chunk.requires_grad_(False)
        self.model = chunks
        self.config = self.bridge.config
        self.replay = RoutingReplay(self.bare_chunks(), self.config) if self.spec.routing_replay else None

    def _build_chunks(self) -> list:
        """One GPTModel per virtual pipeline stage of this rank. With pp=2, vpp=2 and 4 layers,
        rank 0 builds layers 0 and 2, rank 1 layers 1 and 3; the embedding lives in virtual stage 0
        of the first rank, the output layer in the last virtual stage of the last rank."""
        from megatron.core import parallel_state as ps

        provider = self.bridge._model_provider(vh.value_model_callbacks() if self.spec.value_head else [])
        vpp = self.spec.parallel.vpp
        chunks = []
        for i in range(vpp):
            stage = i if vpp > 1 else None
            chunks.append(
                provider(
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                    vp_stage=stage,
                )
            )
        return chunks

    def _wrap_ddp(self, chunks: list) -> list:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.spec.optim.use_distributed_optimizer,
            average_in_collective=False,
        )
        ddps = [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c) for c in chunks]
        config = chunks[0].config  # one TransformerConfig shared by all chunks
        config.finalize_model_grads_func = finalize_model_grads
        # the interleaved schedule enters every chunk's no_sync at once; the others take one
        config.no_sync_func = [d.no_sync for d in ddps] if len(ddps) > 1 else ddps[0].no_sync
        return ddps

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

    def logprob_head(self, temperature: float, entropy_grad: bool = True, with_entropy: bool = True) -> Head:
        """(log p(label), entropy) per position from the output layer fused into the chunked head
        (output_head.py). entropy_grad=False: entropy as a metric (detached); with_entropy=False:
        (log p(label),)."""
        return PolicyHead(temperature, entropy_grad, with_entropy, self.spec.logits_memory)

    def _run(self, batch: Batch, loss_fn: LossFn | None, head: Head, forward_only: bool):
        """One pass of megatron's pipeline schedule over `batch` split into micro-batches.

        `head` turns the model's output into per-position tensors; the engine aligns them with the
        responses ([b, R] each) and hands them to `loss_fn`. Returns, on the last pipeline stage,
        (the head's tensors [B, R] in the batch's row order, per-micro-batch metrics); on other
        stages (None, []).
        """
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cpu_compat.activate()
        cp_group = ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None
        micro, inputs, order = self._micro_batches(batch, cp_group)
        cp_rank = ps.get_context_parallel_rank()
        results = []

        def forward_step(data_iterator, model):
            mb, x = next(data_iterator)
            cu = x.get("cu_seqlens")
            output = model(
                split_for_cp(x["input_ids"], cp_group, cu_seqlens=cu),
                split_for_cp(x["position_ids"], cp_group, cu_seqlens=cu),
                None,
                packed_seq_params=x.get("packed_seq_params"),
                padding_mask=self._local_padding_mask(model, x, cp_group),
                output_processor=getattr(head, "output_processor", None),  # the policy's fused head
            )
            local_labels = split_for_cp(x["labels"], cp_group, cu_seqlens=cu)

            def loss_func(output):
                # Under CP every rank assembles the full sequence and computes the same loss on it;
                # the gather's backward keeps only this rank's tokens, so each token's gradient
                # flows once (context_parallel._GatherSeq).
                per_token = tuple(
                    rows.response_values(gather_from_cp(v, cp_group, cu_seqlens=cu), mb, x["offsets"])
                    for v in head(output, local_labels)
                )
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
            data_iterator=[iter(list(zip(micro, inputs))) for _ in self.model],  # each chunk reads every micro-batch
            model=self.model,
            num_microbatches=len(micro),
            seq_length=max(x["input_ids"].shape[1] for x in inputs),
            micro_batch_size=max(x["input_ids"].shape[0] for x in inputs),
            forward_only=forward_only,
        )
        if not results:
            return None, []
        tensors = tuple(torch.cat(column).cpu() for column in zip(*(r[0] for r in results)))
        return rows.in_row_order(tensors, order), [r[1] for r in results]

    def _micro_batches(self, batch: Batch, cp_group) -> tuple[list[Batch], list[dict], torch.Tensor | None]:
        """`batch` split into micro-batches, their model inputs (packed or padded) on the model's
        device, and the permutation that put the rows in micro-batch order (None: unchanged)."""
        micro, order = rows.micro_batches(
            batch, self.spec.micro_batch_size, self.spec.max_tokens_per_micro_batch, self.spec.parallel
        )
        if self.spec.pack_sequences:  # the allgather dispatcher (no variable lengths): one length everywhere
            inputs = rows.packed_inputs(
                micro, self.spec.parallel, self.config.variable_seq_lengths, agree=rows.agreed_max
            )
        else:
            longest = max(mb["input_ids"].shape[1] for mb in micro)
            fixed = not self.config.variable_seq_lengths
            inputs = rows.padded_inputs(micro, self._padded_length(rows.agreed_max(longest) if fixed else longest))
        if self.replay is not None:  # each micro-batch's expert records, queued for the routers
            self.replay.attach(micro, inputs, cp_group)
        device = rows.model_device(self.model)
        if device.type != "cpu":  # rows arrive on the host; the model and the loss run on its device
            micro = [mb.to(device) for mb in micro]
            inputs = [rows.inputs_to(x, device) for x in inputs]
        return micro, inputs, order

    def _local_padding_mask(self, model, x: dict, cp_group) -> torch.Tensor:
        """This rank's part of the padding mask (True = padding), which keeps padding tokens out of
        the MoE router's statistics (the expert-bias load counts and the aux / z losses): counted,
        they change DeepSeek-V3's expert bias with the layout's padding. GPTModel scatters the mask
        for sequence parallel only on the first pipeline stage; later stages get it pre-sliced."""
        mask = split_for_cp(x["padding_mask"], cp_group, cu_seqlens=x.get("cu_seqlens"))
        if self.spec.parallel.sequence_parallel and not getattr(model, "module", model).pre_process:
            from megatron.core import parallel_state as ps

            n = mask.shape[1] // ps.get_tensor_model_parallel_world_size()
            rank = ps.get_tensor_model_parallel_rank()
            mask = mask[:, rank * n : (rank + 1) * n]
        return mask

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch, temperature: float = 1.0, with_entropy: bool = True) -> Batch | None:
        """log-probs and (with_entropy) entropy of `responses` under the current weights ([B, R] each)."""
        for chunk in self.model:
            chunk.eval()
        tensors, _ = self._run(batch, None, self.logprob_head(temperature, with_entropy=with_entropy), True)
        if tensors is None:
            return None
        return Batch(dict(zip(("log_probs", "entropy"), tensors)))

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch | None:
        """The value model's estimate at each position that predicts a response token ([B, R])."""
        for chunk in self.model:
            chunk.eval()
        tensors, _ = self._run(batch, None, vh.value_head, forward_only=True)
        if tensors is None:
            return None
        return Batch({"values": tensors[0]})

    def train_mini_batch(
        self, batch: Batch, loss_fn: LossFn, temperature: float = 1.0, head: Head | None = None, prefix: str = "actor"
    ) -> dict:
        """One optimizer step over `batch` (this rank's share of a mini-batch); `head` defaults to
        the policy's log-prob head, so loss_fn receives (log_prob, entropy, micro-batch)."""
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        _, per_micro_batch = self._run(batch, loss_fn, head or self.logprob_head(temperature), forward_only=False)
        ok, grad_norm, _ = self.optimizer.step() if grads_finite(self.model) else (False, float("nan"), None)
        metrics = mean_metrics(per_micro_batch)
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

    def _named(self):
        """Each weight of this rank by global name, LoRA adapters merged in (None: the parameters)."""
        if self.spec.lora is None:
            return None
        from megarl.engine.megatron.lora import merged_tensors
        from megarl.engine.megatron.weights import global_tensors

        return merged_tensors(self.bare_chunks(), global_tensors(self.bare_chunks()), adapted_only=False)

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full tensor) for every weight; a collective: call it on every rank."""
        return export_hf_weights(self.bridge, self.bare_chunks(), self._named())

    def export_owned_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What this rank sends in the distributed transport (weights.export_owned_hf_weights)."""
        return export_owned_hf_weights(self.bridge, self.bare_chunks(), self._named())

    def sends_owned_weights(self) -> bool:
        return sends_owned_weights(self.bare_chunks(), self._named())

    def sync_source(self):
        """What a weight sync reads: the engine, or with LoRA only the adapted weights, merged."""
        if self.spec.lora is None:
            return self
        from megarl.engine.megatron.lora_io import AdaptedWeights

        return AdaptedWeights(self)

    def local_pieces(self) -> list:
        """The HF boxes this rank produces from its own shards (shards.local_hf_pieces)."""
        from megarl.engine.megatron.shards import local_hf_pieces

        return local_hf_pieces(self.bridge, self.bare_chunks())

    def bare_chunks(self) -> list:
        """The GPTModel of every virtual pipeline stage, without the DDP wrapper (one without VPP)."""
        from megatron.core.distributed import DistributedDataParallel

        return [c.module if isinstance(c, DistributedDataParallel) else c for c in self.model]

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> dict:
        """Model, optimizer and RNG to `path` (torch_dist, written atomically); a collective.
        Returns the checkpoint's metadata (checkpoint.save)."""
        from megarl.engine.megatron import checkpoint

        cpu_compat.activate()
        return checkpoint.save(self, path)

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> dict:
        """Restore a checkpoint saved from any TP / PP / EP layout; a collective. RNG state is
        restored only into the layout it was saved from. Returns what was restored."""
        from megarl.engine.megatron import checkpoint

        cpu_compat.activate()
        return checkpoint.load(self, path, load_optimizer=load_optimizer)


def mean_metrics(dicts: list[dict]) -> dict:
    """Per key, the mean over the dicts that have it."""
    keys = {k for d in dicts for k in d}
    return {k: sum(float(d[k]) for d in dicts if k in d) / sum(k in d for d in dicts) for k in keys}
