"""The critic's model: the policy's GPTModel with a scalar value head instead of the vocab output.

mbridge's `make_value_model` callback swaps the last stage's `output_layer` for a hidden -> 1
linear (`LinearForLastLayer`) that is replicated over tensor-parallel ranks, not vocab-parallel:
every TP rank computes the same values from the same hidden states. Under sequence parallel each
rank scores its slice of the sequence and all-gathers the values; the weight is marked
`sequence_parallel`, so Megatron all-reduces its gradient over TP (finalize_model_grads), as it
does for layer norms. The decoder is initialised from the policy's checkpoint; the head (absent
from it) from a seeded generator, identically on every rank and for every layout.
"""

from __future__ import annotations

import torch

VALUE_HEAD_PREFIX = "output_layer."


def value_model_callbacks() -> list:
    from mbridge.utils.post_creation_callbacks import make_value_model

    return [make_value_model]


def untie_embeddings(hf_config) -> None:
    """A value model has no vocab output to tie the embedding to. Left tied, Megatron would treat
    the head as the last stage's copy of the embedding (all-reduced with it under PP)."""
    hf_config.tie_word_embeddings = False


@torch.no_grad()
def init_value_head(model, seed: int, std: float) -> None:
    """N(0, std) from `seed`, the same tensor on every rank (no-op before the last stage)."""
    head = getattr(model, "output_layer", None)
    if head is None or not getattr(model, "post_process", False):
        return
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(head.weight.shape, generator=gen, dtype=torch.float64) * std
    head.weight.copy_(weight.to(head.weight.dtype))
    if head.bias is not None:
        head.bias.zero_()


def value_head(output: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor]:
    """engine.Head for the value model: output [b, s, 1] -> (values [b, s],); labels unused."""
    return (output.squeeze(-1).float(),)
