"""MoE routing replay (R3): the trainer's routers take the rollout engine's expert choices.

With actor.moe.routing_replay the rows carry `routed_experts` [B, T, layers * top_k] (the rollout's
choices for every token, -1 where it routed none; megarl/wire/routing.py). In every forward of
compute_log_prob, of the update and of the reference, each MoE layer routes token t to exactly the
experts the rollout chose for it; the routing probabilities are still the trainer's own scores at
those experts (softmax or sigmoid, normalised and scaled as configured), so the router gets its
gradient as in verl's and slime's R3. The reference, when it is the same MoE (it is: it is built
from the actor's spec), replays too: the KL then measures how far the weights moved, not the two
engines' routing disagreements. Tokens without a record (a row's last token, padding) and routers
past num_hidden_layers (multi-token-prediction layers, which SGLang does not record) route freely.

How it hooks Megatron: megatron-core's TopKRouter asks its `router_replay` object for the top-k
(moe_utils.topk_routing_with_score_function -> router_replay.get_replay_topk); every router gets a
`_LayerReplay` there. The indices follow the tokens wherever they are computed:

- `attach` lays each micro-batch's records out exactly as the model lays out its tokens (packed THD
  stream or right-padded rows, the CP split of context_parallel.py, the sequence-parallel scatter
  over TP ranks, then Megatron's [s, b] token order) and queues them on every model chunk;
- a forward pre-hook on each chunk takes the next micro-batch's records (the pipeline schedules run
  a chunk's micro-batches in order) and hands each router its layer's column (layer_number is
  global, so PP and VPP stages pick their own layers);
- under EP routing happens before the token dispatch, so the replayed ids travel with the tokens;
- recomputation (actor.recompute=full) runs a layer's forward again inside the backward pass:
  each router keeps the indices of its training forwards in order and the recompute takes them
  back in the same order (backward visits a chunk's micro-batches in forward order).
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from megarl.data.batch import Batch
from megarl.engine.megatron.context_parallel import split_for_cp
from megarl.engine.megatron.packing import row_lengths

COLUMN = "routed_experts"


class _LayerReplay:
    """What megatron-core's TopKRouter calls as its `router_replay` (RouterReplay's interface)."""

    def __init__(self):
        self.layer_number: int | None = None  # set by TopKRouter.set_layer_number (for messages)
        self.target: torch.Tensor | None = None  # [tokens, top_k] for the next forward; -1: free
        self.recompute: collections.deque[torch.Tensor] = collections.deque()

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if torch._C._current_graph_task_id() != -1 and self.recompute:  # recomputed inside backward
            target = self.recompute.popleft()
        else:  # a first forward; Megatron's full recompute runs it under no_grad, so always keep it
            target, self.target = self.target, None
            if target is not None:
                self.recompute.append(target)
        own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if target is None:
            return own
        if target.shape != own[1].shape:
            raise RuntimeError(
                f"routing replay: layer {self.layer_number} routes {tuple(own[1].shape)} "
                f"tokens x top_k but the replayed records are {tuple(target.shape)}; the "
                "records were laid out for another token layout"
            )
        index = torch.where(target < 0, own[1], target.to(own[1].dtype))
        return scores.gather(1, index), index


class RoutingReplay:
    """Every TopKRouter of `chunks` (bare GPTModels) replays the records `attach` queues."""

    def __init__(self, chunks: list, config):
        from megatron.core.transformer.moe.router import TopKRouter

        refuse = [
            (config.moe_router_fusion, "moe_router_fusion (the fused kernel has no replay hook)"),
            (
                config.moe_router_load_balancing_type in ("sinkhorn", "quantile_balancing"),
                f"moe_router_load_balancing_type={config.moe_router_load_balancing_type}",
            ),
            (config.moe_expert_capacity_factor is not None, "token dropping (moe_expert_capacity_factor)"),
        ]
        for bad, what in refuse:
            if bad:
                raise ValueError(f"actor.moe.routing_replay cannot replay the rollout's experts with {what}")
        self.num_layers, self.top_k = config.num_layers, config.moe_router_topk
        self.sequence_parallel = bool(config.sequence_parallel)
        self._routers: dict[int, list] = {}
        self._queues: dict[int, collections.deque] = {}
        for chunk in chunks:
            routers = [m for m in chunk.modules() if isinstance(m, TopKRouter)]
            for router in routers:  # a pipeline stage of dense layers only has none: nothing to do
                router.router_replay = _LayerReplay()
            self._routers[id(chunk)] = routers
            self._queues[id(chunk)] = collections.deque()
            chunk.register_forward_pre_hook(self._pre_hook)

    def attach(self, micro: list[Batch], inputs: list[dict], cp_group) -> None:
        """Queue each micro-batch's records, laid out as `inputs` lay out its tokens, on every chunk."""
        for queue in self._queues.values():
            queue.clear()  # a pass that failed part-way left some behind
        for routers in self._routers.values():
            for router in routers:
                router.router_replay.recompute.clear()
        for mb, x in zip(micro, inputs):
            if COLUMN not in mb:
                raise ValueError(
                    f"actor.moe.routing_replay is on but the batch has no {COLUMN!r} column; the "
                    "rollout must be asked for return_routed_experts (SamplingSpec)"
                )
            local = self._local_records(mb, x, cp_group)
            for queue in self._queues.values():
                queue.append(local)

    def _local_records(self, mb: Batch, x: dict, cp_group) -> torch.Tensor:
        """This rank's records [tokens, layers, top_k] in the order its routers see the tokens."""
        records = mb[COLUMN]
        width = self.num_layers * self.top_k
        if records.shape[-1] != width:
            raise ValueError(
                f"{COLUMN} holds {records.shape[-1]} expert ids per token but this model routes "
                f"num_layers x top_k = {self.num_layers} x {self.top_k}; were the rows generated by "
                "another model?"
            )
        stream = torch.full((*x["input_ids"].shape, width), -1, dtype=torch.long)
        lengths = row_lengths(mb["input_ids"], mb["prompt_lengths"], mb["response_mask"])
        if "cu_seqlens" in x:  # packed: row i's tokens at offsets[i] .. offsets[i] + length
            for i, (start, n) in enumerate(zip(x["offsets"].tolist(), lengths.tolist())):
                stream[0, start : start + n] = records[i, :n].long()
        else:  # right-padded rows [b, T]
            n = min(records.shape[1], stream.shape[1])
            stream[:, :n] = records[:, :n].long()
        stream = split_for_cp(stream, cp_group, cu_seqlens=x.get("cu_seqlens"))
        if self.sequence_parallel:  # Megatron scatters the sequence over the TP ranks in equal pieces
            from megatron.core import parallel_state as ps

            group = ps.get_tensor_model_parallel_group()
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            piece = stream.shape[1] // size
            stream = stream[:, rank * piece : (rank + 1) * piece]
        # Megatron's hidden states are [s, b, h] and the router flattens them s-major
        return stream.transpose(0, 1).reshape(-1, self.num_layers, self.top_k)

    def _pre_hook(self, chunk, args):
        queue = self._queues[id(chunk)]
        if not queue:  # called outside a replaying pass (a direct model call): route freely
            return
        local = queue.popleft()
        device = next(chunk.parameters()).device
        local = local.to(device, non_blocking=True)
        for router in self._routers[id(chunk)]:
            if router.layer_number <= self.num_layers:  # global layer numbers, from 1
                router.router_replay.target = local[:, router.layer_number - 1]
