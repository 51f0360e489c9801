"""Fixes for megatron-core bugs met on every device (CPU-only patches live in cpu_compat.py).

Each fix names the version it was found in and the error; `apply()` is idempotent and is called
when an engine initializes.
"""

from __future__ import annotations

import torch

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    _fix_expert_bias_padding_mask()
    _APPLIED = True


def _fix_expert_bias_padding_mask() -> None:
    # megatron-core 0.19.2, TopKRouter.routing: the padding mask is flattened to [tokens] and then
    # `routing_map & ~padding_mask` is taken against routing_map [tokens, experts]: "Attempting to
    # broadcast a dimension of length T" whenever a padding mask is passed and the router keeps an
    # expert bias (DeepSeek-V3). The mask must drop whole rows of the routing map.
    from megatron.core.transformer.moe.router import TopKRouter

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    TopKRouter._apply_expert_bias = _apply_expert_bias
