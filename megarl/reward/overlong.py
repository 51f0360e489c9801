"""DAPO's overlong reward shaping: a soft penalty for responses that run into the length limit.

With rollout.max_new_tokens = L and reward.overlong_buffer.len = B, a response of length l gets
0 when l <= L - B, and -(l - (L - B)) / B * penalty_factor beyond that: -penalty_factor at the
limit, where a response was most likely cut off. It is added to the task score; the unshaped
score is kept as `raw_scores` (dynamic sampling judges groups on it) and logged as reward/raw_mean.
"""

from __future__ import annotations

import torch


def overlong_penalty(
    lengths: torch.Tensor, max_new_tokens: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"overlong buffer length {buffer_len} must be in (0, max_new_tokens={max_new_tokens}]")
    expected = max_new_tokens - buffer_len
    exceed = lengths.to(torch.float32) - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
