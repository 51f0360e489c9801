"""Pack a micro-batch of right-padded rows into one THD sequence (no padding between rows).

The engine's row layout (engine.py) is right-padded [b, T]; a long-tail batch spends most of its
attention and MLP work on padding. Packed, the rows become one stream [1, t] with t = sum of the
rows' real lengths, and `cu_seqlens` (cumulative lengths) tells attention and RoPE where each
sequence starts, so no token sees another row's tokens and every row's positions start at 0.

Each row is padded only as far as the layout needs: to a multiple of 2*cp under context parallel
(each sequence is cut into 2*cp chunks, context_parallel.py), and the whole stream to a multiple of
tp under sequence parallel (SP scatters the stream over TP ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def row_lengths(input_ids: torch.Tensor, prompt_lengths: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Real tokens per row: its prompt plus its response up to the last token with mask 1. [b] int64.
    An agent trajectory's response has tool tokens (mask 0) between the model's; they are real
    tokens the model reads, so the length runs to the last model token, not the count of 1s."""
    positions = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    last = (
        (positions * (response_mask > 0)).amax(dim=1)
        if response_mask.shape[1]
        else torch.zeros(response_mask.shape[0], dtype=torch.long)
    )
    lengths = prompt_lengths.long() + last.long()
    if int(lengths.max()) > input_ids.shape[1]:
        raise ValueError(
            f"a row claims {int(lengths.max())} tokens but input_ids has only "
            f"{input_ids.shape[1]} columns: prompt_lengths / response_mask disagree "
            "with input_ids"
        )
    return lengths.clamp(min=1)


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [1, t]
    position_ids: torch.Tensor  # [1, t], restarting at 0 for every row
    labels: torch.Tensor  # [1, t], the next token within the same row (0 at a row's end)
    padding_mask: torch.Tensor  # [1, t] bool, True at padding (kept out of MoE routing statistics)
    offsets: torch.Tensor  # [b], where each row starts in the stream
    cu_seqlens: torch.Tensor  # [b + 1] int32, the padded layout (what attention and RoPE use)
    max_seqlen: int

    def packed_seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        # Only the padded layout is given: a row's padding sits after its real tokens, and causal
        # attention keeps real tokens from seeing it (TE on GPU would take the unpadded lengths too).
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens,
            cu_seqlens_kv_padded=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def padded_row_lengths(
    lengths: torch.Tensor, row_multiple: int = 1, total_multiple: int = 1, total: int | None = None
) -> torch.Tensor:
    """Each row's length in the stream: a multiple of `row_multiple`; the last row takes extra
    padding so the stream's length divides by `total_multiple`, or equals `total` when given."""
    padded = torch.div(lengths + row_multiple - 1, row_multiple, rounding_mode="floor") * row_multiple
    stream = int(padded.sum())
    multiple = math.lcm(row_multiple, total_multiple)  # the extra padding stays a row multiple
    target = int(math.ceil(stream / multiple) * multiple)
    if total is not None:
        if total < target or total % multiple:
            raise ValueError(f"packing: cannot pad a stream of {stream} tokens to {total}")
        target = total
    padded[-1] += target - stream
    return padded


def pack_rows(input_ids: torch.Tensor, lengths: torch.Tensor, padded: torch.Tensor) -> PackedRows:
    """Concatenate row i's first lengths[i] tokens, each row followed by its own padding (zeros)."""
    b = input_ids.shape[0]
    cu = torch.zeros(b + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(padded, 0)
    t = int(cu[-1])
    offsets = cu[:-1]
    # stream position -> (row, column) for the real tokens; everything else stays 0
    row_of = torch.repeat_interleave(torch.arange(b), padded)
    col = torch.arange(t) - offsets[row_of]
    real = col < lengths[row_of]
    ids = torch.zeros(t, dtype=input_ids.dtype)
    ids[real] = input_ids[row_of[real], col[real]]
    labels = torch.zeros(t, dtype=input_ids.dtype)
    has_next = col + 1 < lengths[row_of]
    labels[has_next] = input_ids[row_of[has_next], col[has_next] + 1]
    return PackedRows(
        input_ids=ids.unsqueeze(0),
        position_ids=col.unsqueeze(0),
        labels=labels.unsqueeze(0),
        padding_mask=~real.unsqueeze(0),
        offsets=offsets,
        cu_seqlens=cu.to(torch.int32),
        max_seqlen=int(padded.max()),
    )
