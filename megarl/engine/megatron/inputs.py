"""How rows become the model's inputs, and the model's outputs come back to the rows.

A call's rows are cut into micro-batches (by row count or by token budget, the same number on
every data-parallel rank, rounded for the interleaved pipeline schedule). The micro-batches
(engine.py's row layout) become either right-padded [b, T] inputs or one packed THD stream per
micro-batch (packing.py); per-position outputs are read back at the positions that predict
response tokens. Inputs and parameters go to the model's device
(the host on CPU, this process's GPU otherwise).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megarl.config.schema import ParallelConfig
from megarl.data.batch import Batch
from megarl.engine.megatron.packing import pack_rows, padded_row_lengths, row_lengths


def padded_inputs(micro: list[Batch], seq_len: int) -> list[dict]:
    """Right-padded rows [b, T], every micro-batch padded to the same T (the pipeline's
    tensor shape), positions 0..T-1, labels[t] = ids[t+1] within the row."""
    out = []
    for mb in micro:
        ids = torch.nn.functional.pad(mb["input_ids"], (0, seq_len - mb["input_ids"].shape[1]), value=0)
        # shifted on the full sequence, BEFORE the CP split, so a rank's last local token still
        # gets its label from the next chunk (which another rank holds)
        lengths = row_lengths(mb["input_ids"], mb["prompt_lengths"], mb["response_mask"])
        out.append(
            dict(
                input_ids=ids,
                position_ids=torch.arange(seq_len).unsqueeze(0).expand_as(ids),
                labels=torch.nn.functional.pad(ids[:, 1:], (0, 1), value=0),
                padding_mask=torch.arange(seq_len).unsqueeze(0) >= lengths.unsqueeze(1),
                offsets=torch.arange(len(mb)) * seq_len,
            )
        )
    return out


def agreed_max(value: int) -> int:
    """The largest `value` over the data-parallel (with context-parallel) group: a length every
    rank of an expert-parallel group must share (the allgather dispatcher all-gathers tokens, which
    needs the same count on every rank; data-parallel ranks hold different rows)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    t = torch.tensor(value)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group(with_context_parallel=True))
    return int(t)


def packed_inputs(micro: list[Batch], p: ParallelConfig, variable_seq_lengths: bool, agree=None) -> list[dict]:
    """One THD stream [1, t] per micro-batch (packing.py): rows back to back, each padded to a
    multiple of 2*cp, the stream to a multiple of tp under sequence parallel. Without variable
    sequence lengths in the pipeline (the allgather dispatcher) every stream has one length, on
    every rank: `agree` (agreed_max) makes it the longest over the data-parallel ranks."""
    row_multiple = 2 * p.cp if p.cp > 1 else 1
    total_multiple = p.tp if p.sequence_parallel else 1
    lengths = [row_lengths(mb["input_ids"], mb["prompt_lengths"], mb["response_mask"]) for mb in micro]
    padded = [padded_row_lengths(n, row_multiple, total_multiple) for n in lengths]
    if not variable_seq_lengths:
        total = max(int(x.sum()) for x in padded)
        total = agree(total) if agree is not None else total
        total = int(math.ceil(total / math.lcm(row_multiple, total_multiple)) * math.lcm(row_multiple, total_multiple))
        padded = [padded_row_lengths(n, row_multiple, total_multiple, total=total) for n in lengths]
    out = []
    for mb, n, pad in zip(micro, lengths, padded):
        packed = pack_rows(mb["input_ids"], n, pad)
        out.append(
            dict(
                input_ids=packed.input_ids,
                position_ids=packed.position_ids,
                labels=packed.labels,
                padding_mask=packed.padding_mask,
                offsets=packed.offsets,
                cu_seqlens=packed.cu_seqlens,
                packed_seq_params=packed.packed_seq_params(),
            )
        )
    return out


def response_values(values: torch.Tensor, mb: Batch, offsets: torch.Tensor) -> torch.Tensor:
    """Pick, per row, the positions that predict response tokens: [b, T] or [1, t] -> [b, R].

    Row i starts at `offsets[i]` of the flattened values (i * T padded, its stream offset packed).
    values at position t score token t+1, so response token j (at prompt_len + j) is read at
    prompt_len - 1 + j. Positions past the row's response are zeroed by response_mask.
    """
    R = mb["responses"].shape[1]
    flat = values.reshape(-1)
    start = offsets.to(flat.device) + mb["prompt_lengths"].long() - 1
    index = (start.unsqueeze(1) + torch.arange(R, device=flat.device).unsqueeze(0)).clamp(max=flat.shape[0] - 1)
    return flat[index] * mb["response_mask"].to(values.dtype)


def place(chunks: list, dtype: torch.dtype) -> None:
    """Every chunk in the parameter dtype, on this process's GPU when there is one.

    The dtype: what Megatron's Float16Module does (module.bfloat16()), without the wrapper (its
    casts are of float inputs, which token ids are not, and of the output, which the heads upcast):
    the norms are built in fp32 whatever params_dtype says. The device: Megatron builds on the
    host (use_cpu_initialization, model.NO_FUSION_ARGS), and DDP's buffers would move only a
    training engine's parameters; a forward-only one (the reference) would stay behind. Meta
    models (checkpoint_convert) have no storage to move.
    """
    for chunk in chunks:
        if dtype is not torch.float32:
            chunk.to(dtype)
        if torch.cuda.is_available() and not any(p.is_meta for p in chunk.parameters()):
            chunk.cuda(torch.cuda.current_device())


def model_device(chunks: list) -> torch.device:
    return next(p for chunk in chunks for p in chunk.parameters()).device


def inputs_to(x: dict, device: torch.device) -> dict:
    """A micro-batch's model inputs on `device`, PackedSeqParams' cu_seqlens included."""
    out = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    params = out.get("packed_seq_params")
    if params is not None:
        out["packed_seq_params"] = dataclasses.replace(
            params,
            **{
                f.name: getattr(params, f.name).to(device)
                for f in dataclasses.fields(params)
                if isinstance(getattr(params, f.name), torch.Tensor)
            },
        )
    return out


# ---------------------------------------------------------------- micro-batch planning
def micro_batches(
    batch: Batch, micro_batch_size: int, max_tokens: int | None, p: ParallelConfig
) -> tuple[list[Batch], torch.Tensor | None]:
    """The micro-batches of one call, and the row order they hold (None: the batch's own).

    By row count (`micro_batch_size`), or by token budget (`max_tokens`, the engine's
    max_tokens_per_micro_batch): rows are grouped so every micro-batch's tokens stay within the
    budget and the groups are balanced (data/balance.py). Every data-parallel rank runs the same
    number of micro-batches (MoE expert-parallel collectives pair them up across ranks), so the
    count is agreed first.
    """
    if max_tokens is None:
        n = max(1, math.ceil(len(batch) / micro_batch_size))
        return batch.chunk(interleaved_micro_batch_count(n, len(batch), p)), None
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.data.balance import min_micro_batches, partition_micro_batches

    lengths = row_lengths(batch["input_ids"], batch["prompt_lengths"], batch["response_mask"]).tolist()
    k = torch.tensor(min_micro_batches(lengths, max_tokens))
    dist.all_reduce(k, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group(with_context_parallel=True))
    k = interleaved_micro_batch_count(int(k), len(batch), p)
    if k > len(batch):
        raise ValueError(
            f"max_tokens_per_micro_batch={max_tokens}: another data-parallel rank needs "
            f"{k} micro-batches but this rank holds only {len(batch)} rows; give "
            "every rank the same number of rows (a batch divisible by dp)"
        )
    parts = partition_micro_batches(lengths, k)
    order = torch.tensor([i for part in parts for i in part])
    return [batch[torch.tensor(part)] for part in parts], order


def interleaved_micro_batch_count(n: int, rows: int, p: ParallelConfig) -> int:
    """`n` micro-batches adjusted for the interleaved schedule (vpp > 1), which runs them in
    groups of pp per virtual stage and refuses fewer than pp or a last group smaller than pp:
    round up to a multiple of pp, or down where rows are too few (micro-batches grow a little)."""
    if p.vpp == 1:
        return n
    if rows < p.pp:
        raise ValueError(
            f"actor.parallel.vpp={p.vpp}: the interleaved pipeline schedule needs at least "
            f"pp={p.pp} micro-batches, but this call has {rows} row(s) on this data-parallel rank; "
            f"send at least {p.pp} rows per rank or set actor.parallel.vpp=1"
        )
    up = math.ceil(n / p.pp) * p.pp
    return up if up <= rows else rows // p.pp * p.pp


def in_row_order(tensors: tuple[torch.Tensor, ...], order: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Per-row tensors in micro-batch order put back in the batch's row order."""
    if order is None:
        return tensors
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return tuple(t[inverse] for t in tensors)
