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

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl.config.schema import OptimConfig, ParallelConfig
from megarl.config.validate import stage_layers
from megarl.data.batch import Batch
from megarl.engine.megatron import inputs as rows
from megarl.engine.megatron import mcore_fixes
from megarl.engine.megatron import value_head as vh
from megarl.engine.megatron.cpu import compat as cpu_compat
from megarl.engine.megatron.grad_guard import grads_finite
from megarl.engine.megatron.lora import LoraSpec
from megarl.engine.megatron.model import make_bridge, pipeline_split_args, precision_dtype, recompute_args
from megarl.engine.megatron.offload import PARTS, HostCopy, offload_groups
from megarl.engine.megatron.optimizer import build_optimizer
from megarl.engine.megatron.passes import Head, LossFn, ModelPasses
from megarl.engine.megatron.routing_replay import RoutingReplay
from megarl.engine.megatron.vlm import make_vlm_bridge
from megarl.engine.megatron.weights import (
    export_hf_weights,
    export_owned_hf_weights,
    load_hf_weights,
    sends_owned_weights,
)
from megarl.models.vision import VisionSpec


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


class MegatronEngine(ModelPasses):
    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.model = None
        self.optimizer = None
        self.replay: RoutingReplay | None = None
        self.vision: VisionSpec | None = None  # a vision-language model's image inputs (vision_inputs.py)
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
        self.vision = VisionSpec.of(hf_config)
        if self.vision is not None:
            check_vision_layout(self.spec)
        if self.spec.value_head:
            vh.untie_embeddings(hf_config)
        training = self.spec.optim is not None
        self.bridge = (make_bridge if self.vision is None else make_vlm_bridge)(
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


def check_vision_layout(spec: EngineSpec) -> None:
    """What a vision-language model does not run with yet, refused before the model is built."""
    p = spec.parallel
    refusals = [
        (p.pp > 1 or p.vpp > 1, f"pp={p.pp}, vpp={p.vpp}: the vision tower runs on one pipeline stage; use pp=1"),
        (p.cp > 1, f"cp={p.cp}: context parallel does not split image tokens yet; use cp=1"),
        (spec.value_head, "a critic (value head): use a critic-free estimator such as grpo"),
        (spec.lora is not None, "LoRA adapters (actor.lora): set actor.lora.rank=0"),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"vision-language model {spec.model_path}: {why}")
