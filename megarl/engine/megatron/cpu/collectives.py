"""Collectives through shared memory for ranks on one CPU host (gloo stays for everything else).

Why: on a VM, a gloo collective between two ranks on one machine costs 0.45-0.9 ms however
small its tensors, because every message crosses TCP and hops between threads that sleep in
between: each hop wakes a halted vCPU. Measured on a 2-core VM (Firecracker, EPYC):
a two-rank all_to_all_single of 80 KB takes 527 us in gloo and 37 us here, and the quickstart's
update step spent 32 ms a step (of 98) in 50 small gloo collectives, 24 of them the MoE
dispatcher's all-to-alls (benchmarks/RESULTS.md, "CPU collectives").

How: each group gets one shared segment (a /dev/shm file, unlinked as soon as every rank has
mapped it). A rank copies its input into its own slot, publishes a sequence number, and spins
until every peer has published the same one, then reads the peers' slots. Slots alternate
between two buffers, so a rank may write op k+2 only after every peer has posted op k+1, that
is, has finished reading op k: one round per collective. Waiting spins for 0.1 ms, then yields
for 20 ms, then sleeps between looks: neither spinning nor yielding halts the vCPU (the point),
and a yield hands the core to any other process that wants it (an engine generating beside the
ranks). It raises when a peer's process is gone or after the group timeout, naming the op and
the rank.

Only the calls on the hot path go here: all_to_all_single, all_gather_into_tensor, all_gather,
all_reduce (sum, max, min, product), reduce_scatter_tensor, broadcast, barrier, on CPU tensors.
All-reduce, reduce-scatter and all-gather-into-tensor of a tensor over the slot (4 MB,
$MEGARL_CPU_COLLECTIVES_MB) go in rounds (their sizes agree on every rank); for the others a
tensor over the slot goes to gloo (every rank learns of it from the header, so all do). Anything
else, a call inside a coalescing manager, or a group spanning hosts goes to gloo unchanged.
Sums add the ranks' tensors in rank order on every rank; for two ranks that is bit-identical to
gloo (a + b == b + a).

Enabled on CPU by cpu_compat.activate(); $MEGARL_CPU_COLLECTIVES picks: `auto` (default: when
the world's ranks fit the host's cores, spinning costs nothing the peers need), `shm`, `gloo`.
x86-64 only: its stores become visible in program order (and torch's copies release the GIL,
whose atomic re-acquire orders even streaming stores); other CPUs keep gloo.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _create_work_from_future

from megarl.engine.megatron.cpu.shm_channel import Channel, open_channel

ENV = "MEGARL_CPU_COLLECTIVES"
ENV_MB = "MEGARL_CPU_COLLECTIVES_MB"
SLOT_MB = 4  # per rank and buffer; larger tensors go through gloo

_INSTALLED = False
_CREATING = object()
_channels: dict = {}  # ProcessGroup -> Channel | None (gloo) | _CREATING
_orig: dict = {}
_REDUCE = {
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.MIN: torch.minimum,
    dist.ReduceOp.PRODUCT: torch.mul,
}


def mode() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "shm", "gloo"):
        raise ValueError(f"${ENV}={value!r}: expected auto, shm or gloo")
    return value


def install() -> bool:
    """Route the hot collectives of CPU ranks through shared memory (idempotent). The wrappers go
    in whatever the mode, so every rank runs the same set-up protocol: each group decides at its
    first collective, from what all its ranks want (gloo, when any says so)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    mode()  # a bad value fails here
    for name, impl in (
        ("all_to_all_single", _all_to_all_single),
        ("all_gather_into_tensor", _all_gather_into),
        ("all_gather", _all_gather),
        ("all_reduce", _all_reduce),
        ("reduce_scatter_tensor", _reduce_scatter),
        ("broadcast", _broadcast),
        ("barrier", _barrier),
        ("destroy_process_group", _destroy),
    ):
        orig = getattr(c10d, name)
        _orig[name] = orig
        wrapped = functools.wraps(orig)(impl)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    _INSTALLED = True
    _rebind_aliases()
    return True


# megatron binds some collectives to module names at import (dist_all_gather_func = ...)
ALIAS_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
    "megatron.core.transformer.multi_token_prediction",
)


def _rebind_aliases() -> None:
    """Point megatron's import-time aliases of the originals at the wrappers (a module imported
    after install() binds the wrappers itself)."""
    wrapped = {id(orig): getattr(c10d, name) for name, orig in _orig.items()}
    for module in filter(None, map(sys.modules.get, ALIAS_MODULES)):
        for attr, value in list(vars(module).items()):
            if id(value) in wrapped:
                setattr(module, attr, wrapped[id(value)])


def _wanted() -> bool:
    """This rank's vote: x86-64 (its stores become visible in program order), and the mode allows it
    (`auto`: the world's ranks fit the host's cores, so spinning costs nothing the peers need)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return x86 and (mode() == "shm" or mode() == "auto" and dist.get_world_size() <= (os.cpu_count() or 1))


def _slot_bytes() -> int:
    return int(float(os.environ.get(ENV_MB, SLOT_MB)) * (1 << 20))


def _channel(group, *tensors) -> Channel | None:
    if group is None:
        group = c10d._get_default_group()
    if group in c10d._world.pg_coalesce_state or c10d._rank_not_in_group(group):
        return None
    if any(t.device.type != "cpu" or t.is_complex() for t in tensors):
        return None
    ch = _channels.get(group)
    if ch is None and group not in _channels:
        _channels[group] = _CREATING  # the set-up's own object collectives take gloo
        try:
            ch = _channels[group] = open_channel(group, _wanted(), _slot_bytes())
        except BaseException:
            _channels.pop(group, None)
            raise
    return ch if isinstance(ch, Channel) else None


def _reduce_fn(op):
    try:
        return _REDUCE.get(op)
    except TypeError:  # a ReduceOp object (premul_sum): gloo's
        return None


def _done(async_op: bool):
    if not async_op:
        return None
    fut = torch.futures.Future()
    fut.set_result(None)
    return _create_work_from_future(fut)


def _reduce(ch: Channel, seq: int, shape, dtype, fn, pick=lambda part: part) -> torch.Tensor:
    """The ranks' posted tensors of op seq combined in rank order (bit-identical on every rank)."""
    nbytes = math.prod(shape) * dtype.itemsize
    parts = [pick(ch.buf(p, seq, nbytes).view(dtype).view(shape)) for p in range(ch.n)]
    acc = fn(parts[0], parts[1])
    for part in parts[2:]:
        acc = fn(acc, part)
    return acc


def _chunks(total: int, per: int):
    """[start, stop) element ranges of at most `per` (a tensor over the slot goes in rounds; the
    sizes of these ops are equal on every rank, so every rank makes the same rounds)."""
    return [(j, min(j + per, total)) for j in range(0, total, max(per, 1))]


def _all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    ch = _channel(group, tensor)
    fn = _reduce_fn(op)
    if ch is None or fn is None or tensor.dtype == torch.bool:
        return _orig["all_reduce"](tensor, op=op, group=group, async_op=async_op)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    for lo, hi in _chunks(flat.numel(), ch.slot // tensor.element_size()):
        seq = ch.post(flat[lo:hi])
        ch.wait(seq, "all_reduce")
        flat[lo:hi].copy_(_reduce(ch, seq, (hi - lo,), tensor.dtype, fn))
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return _done(async_op)


def _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    ch = _channel(group, output, input)
    fn = _reduce_fn(op)
    if ch is None or fn is None or input.dtype == torch.bool or not output.is_contiguous():
        return _orig["reduce_scatter_tensor"](output, input, op=op, group=group, async_op=async_op)
    n, k = ch.n, output.numel()
    rows, out = input.reshape(n, k), output.view(-1)  # row r: what rank r receives
    for lo, hi in _chunks(k, ch.slot // (n * input.element_size())):
        seq = ch.post(rows[:, lo:hi])  # every destination's columns lo..hi, one round
        ch.wait(seq, "reduce_scatter_tensor")
        out[lo:hi].copy_(_reduce(ch, seq, (n, hi - lo), input.dtype, fn, lambda part: part[ch.rank]))
    return _done(async_op)


def _all_gather_into(output_tensor, input_tensor, group=None, async_op=False):
    ch = _channel(group, output_tensor, input_tensor)
    if ch is None or not output_tensor.is_contiguous():
        return _orig["all_gather_into_tensor"](output_tensor, input_tensor, group=group, async_op=async_op)
    k, dtype = input_tensor.numel(), input_tensor.dtype
    flat, out = input_tensor.reshape(-1), output_tensor.view(ch.n, k)
    for lo, hi in _chunks(k, ch.slot // input_tensor.element_size()):
        seq = ch.post(flat[lo:hi])
        ch.wait(seq, "all_gather_into_tensor")
        for p in range(ch.n):
            out[p, lo:hi].copy_(ch.buf(p, seq, (hi - lo) * input_tensor.element_size()).view(dtype))
    return _done(async_op)


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    ch = _channel(group, tensor, *tensor_list)
    if ch is None or any(t.shape != tensor.shape or t.dtype != tensor.dtype for t in tensor_list):
        return _orig["all_gather"](tensor_list, tensor, group=group, async_op=async_op)
    seq = ch.post(tensor)
    if not ch.wait(seq, "all_gather"):
        return _orig["all_gather"](tensor_list, tensor, group=group, async_op=async_op)
    nbytes = tensor.numel() * tensor.element_size()
    for p, out in enumerate(tensor_list):
        out.copy_(ch.buf(p, seq, nbytes).view(tensor.dtype).view(tensor.shape))
    return _done(async_op)


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    ch = _channel(group, output, input)
    if ch is None or not output.is_contiguous():
        return _orig["all_to_all_single"](
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )
    n = ch.n
    row = input.element_size() * math.prod(input.shape[1:])
    # split sizes come as lists, tensors or numpy arrays (megatron's dispatcher)
    ins = [int(s) for s in input_split_sizes] if input_split_sizes is not None else [input.shape[0] // n] * n
    outs = [int(s) for s in output_split_sizes] if output_split_sizes is not None else [output.shape[0] // n] * n
    offsets = [0]
    for s in ins:
        offsets.append(offsets[-1] + s * row)
    seq = ch.post(input, offsets)
    if not ch.wait(seq, "all_to_all_single"):
        return _orig["all_to_all_single"](
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )
    flat, at = output.view(torch.uint8).view(-1) if output.numel() else None, 0
    for p in range(n):
        theirs = ch.offsets(p, seq)
        lo, hi = theirs[ch.rank], theirs[ch.rank + 1]
        if hi - lo != outs[p] * row:
            raise RuntimeError(
                f"all_to_all_single: rank {ch.ranks[p]} sends {(hi - lo) // row} rows to rank "
                f"{ch.ranks[ch.rank]}, whose output_split_sizes expect {outs[p]}"
            )
        if hi > lo:
            flat[at : at + hi - lo].copy_(ch.buf(p, seq, hi)[lo:hi])
        at += hi - lo
    return _done(async_op)


def _broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    ch = _channel(group, tensor)
    if ch is None:
        return _orig["broadcast"](tensor, src=src, group=group, async_op=async_op, group_src=group_src)
    root = group_src if group_src is not None else dist.get_group_rank(ch.group, src)
    seq = ch.post(tensor if ch.rank == root else None)
    nbytes = tensor.numel() * tensor.element_size()
    if not ch.wait(seq, "broadcast"):
        return _orig["broadcast"](tensor, src=src, group=group, async_op=async_op, group_src=group_src)
    if ch.rank != root:
        sent = ch.hdr[ch.field(root, seq)]
        if sent != nbytes:
            raise RuntimeError(
                f"broadcast: rank {ch.ranks[root]} sent {sent} bytes, rank {ch.ranks[ch.rank]} "
                f"expects {nbytes} ({tuple(tensor.shape)} {tensor.dtype})"
            )
        tensor.copy_(ch.buf(root, seq, nbytes).view(tensor.dtype).view(tensor.shape))
    return _done(async_op)


def _barrier(group=None, async_op=False, device_ids=None, timeout=None):
    ch = _channel(group)
    if ch is None:
        return _orig["barrier"](group=group, async_op=async_op, device_ids=device_ids, timeout=timeout)
    ch.wait(ch.post(None), "barrier")
    return _done(async_op)


def _destroy(group=None):
    """Drop the channels of the groups destroyed (all of them with the default group)."""
    if group is None or group is c10d.GroupMember.WORLD:
        _channels.clear()
    else:
        _channels.pop(group, None)
    return _orig["destroy_process_group"](group)
