"""The engine's passes over a call's rows: micro-batches through Megatron's pipeline schedule.

`ModelPasses._run` is what compute_log_prob, compute_values and train_mini_batch share: the rows cut
into micro-batches (inputs.py), each micro-batch's model inputs (packed or padded; a
vision-language model's images and 3-D positions, vision_inputs.py), one forward (and backward)
per micro-batch under the pipeline schedule, and the head's per-position outputs read back at
the response tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from megarl.data.batch import Batch
from megarl.engine.megatron import inputs as rows
from megarl.engine.megatron.context_parallel import gather_from_cp, split_for_cp
from megarl.engine.megatron.cpu import compat as cpu_compat
from megarl.engine.megatron.output_head import PolicyHead
from megarl.engine.megatron.vision_inputs import add_vision_inputs, model_kwargs

# A head maps the last stage's model output on this rank and the local labels [b, s] to
# per-position tensors [b, s]: (log_prob, entropy) for the policy (output_head.PolicyHead, whose
# output_processor the model runs instead of its output layer), (values,) for the critic.
Head = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
# A loss function maps the head's tensors aligned with the responses ([b, R] each) and the micro-batch
# to (loss summed over its units, number of units, metrics). Megatron divides the summed gradient by
# the units of the whole mini-batch across data-parallel ranks (calculate_per_token_loss).
LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, dict]]


class ModelPasses:
    """The forward / backward half of MegatronEngine (engine.py holds its state: spec, model,
    config, replay, vision)."""

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
                **model_kwargs(x),
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
        if self.vision is not None:
            add_vision_inputs(micro, inputs, self.vision, self.config.params_dtype)
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
