"""The policy's head: GPTModel's output layer fused into the chunked log-prob / entropy head.

GPTModel hands its `output_processor` hook the final norm's output [s, b, h] (this rank's part
of the sequence under sequence parallel) and its output layer. `PolicyHead.output_processor`
does what the output layer's ColumnParallelLinear does to its input, the sequence-parallel
all-gather (reduce-scatter in backward) or the copy into the tensor-parallel region (all-reduce
in backward), and hands the hidden states and the vocab-parallel weight on instead of the
logits; the head then makes the logits one chunk of tokens at a time (logprob.py), so no
[tokens, vocab] tensor exists for a micro-batch. The output layer itself stays in the model,
unchanged: same parameter and name (checkpoints, weight export), and whatever else reads it
(multi-token prediction, a plain forward) still gets logits. The weight is the output layer's,
or the shared embedding's when the two are tied (GPTModel passes that one as `output_weight`).
`logits_memory` (actor.logits_memory) says whether a training micro-batch keeps its logits for
backward or has them made again there (logprob.keeps_logits).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from megarl.engine.megatron.logprob import fused_linear_logprob_entropy, keeps_logits


class HeadInput(NamedTuple):
    """What the last stage's model returns to a PolicyHead instead of logits."""

    hidden: torch.Tensor  # [s, b, h]: the whole (CP-local) sequence, the same on every TP rank
    weight: torch.Tensor  # [V / tp, h]: this rank's vocab slice of the output weight
    group: object  # the tensor-parallel group the vocabulary is split over
    logit_scale: float  # MuP's output multiplier (1 without MuP)


def output_region(hidden: torch.Tensor, output_layer) -> torch.Tensor:
    """The output layer's input as its ColumnParallelLinear sees it, with the same backward."""
    from megatron.core.tensor_parallel import mappings

    if output_layer.sequence_parallel:
        return mappings.gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=True, group=output_layer.tp_group
        )
    return mappings.copy_to_tensor_model_parallel_region(hidden, group=output_layer.tp_group)


class PolicyHead:
    """engine.Head for the policy: (hidden, output weight) and labels [b, s] -> (log p(label),
    entropy) per position, each [b, s]; (log p(label),) alone when with_entropy is False.
    entropy_grad=False: the entropy is a metric (detached). logits_memory: auto | keep | recompute
    (logprob.keeps_logits; a pass without gradients keeps nothing). Pass `output_processor` to
    the model."""

    def __init__(
        self, temperature: float, entropy_grad: bool = True, with_entropy: bool = True, logits_memory: str = "auto"
    ):
        self.temperature = temperature
        self.entropy_grad = entropy_grad
        self.with_entropy = with_entropy
        self.logits_memory = logits_memory

    def output_processor(self, *, hidden_states, output_layer, output_weight, config, **_) -> HeadInput:
        """GPTModel._postprocess's hook: called on the last pipeline stage instead of the output layer."""
        weight = output_layer.weight if output_weight is None else output_weight
        lora = getattr(output_layer, "lora", None)  # LoRA on lm_head (lora.py): the head reads W + scale B A
        if lora is not None and lora.enabled and output_weight is None:
            weight = weight + lora.weight_delta().to(weight.dtype)
        scale = config.mup_output_mult if config.use_mup else 1.0  # GPTModel._scale_logits
        return HeadInput(output_region(hidden_states, output_layer), weight, output_layer.tp_group, scale)

    def __call__(self, output: HeadInput, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        group = output.group if dist.get_world_size(output.group) > 1 else None
        vocab_start = dist.get_rank(output.group) * output.weight.shape[0] if group is not None else 0
        temperature = self.temperature if self.temperature != 0.0 else 1.0  # greedy: scored at T = 1
        tokens = output.hidden.numel() // output.hidden.shape[-1]
        log_prob, entropy = fused_linear_logprob_entropy(
            output.hidden,
            output.weight,
            labels.t(),  # the hidden states are sequence-major; the results are transposed back
            keep_logits=keeps_logits(self.logits_memory, tokens, output.weight.shape[0], output.hidden.dtype),
            vocab_start=vocab_start,
            group=group,
            temperature=temperature / output.logit_scale,  # (x * scale) / T
            with_entropy=self.with_entropy,
            entropy_grad=self.entropy_grad,
        )
        if not self.with_entropy:
            return (log_prob.t(),)
        return log_prob.t(), entropy.t()
