"""Shared-memory collectives (megarl/engine/megatron/cpu/collectives.py) against gloo itself.

Every rank computes each op twice, through shared memory and through gloo's own function (the
wrapped original), on the same inputs; two ranks must agree bit for bit, three to float
tolerance (gloo sums in another order)."""

from __future__ import annotations

import os

import numpy
import pytest
import torch

from tests._dist import run_ranks


def _ops(rank: int, n: int, group=None):
    """(name, run(impl) -> tensors) for every wrapped op, with inputs seeded by rank."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(6, 5, generator=g)
    ints = torch.randint(-50, 50, (7,), generator=g)
    # uneven all-to-all: rank r sends (r + p) % 3 rows to rank p (zero rows included)
    ins = [(rank + p) % 3 for p in range(n)]
    outs = [(p + rank) % 3 for p in range(n)]
    rows = torch.randn(sum(ins), 4, generator=g)

    def a2a(fns):
        out = torch.full((sum(outs), 4), float("nan"))
        fns["all_to_all_single"](out, rows, outs, ins, group=group)
        even = torch.empty(2 * n, 3)  # equal splits (none given), numpy split sizes (megatron's)
        fns["all_to_all_single"](even, x[: 2 * n, :3].contiguous(), group=group)
        again = torch.empty_like(out)
        fns["all_to_all_single"](again, rows, numpy.array(outs), numpy.array(ins), group=group)
        return [out, even, again]

    def reduce(fns):
        a, b, c = x.clone(), ints.clone(), x.clone()
        fns["all_reduce"](a, group=group)
        fns["all_reduce"](b, op=dist.ReduceOp.MAX, group=group)
        work = fns["all_reduce"](c, op=dist.ReduceOp.MIN, group=group, async_op=True)
        work.wait()
        return [a, b, c]

    def scatter(fns):
        out = torch.empty(2, 5)
        fns["reduce_scatter_tensor"](
            out, torch.randn(2 * n, 5, generator=torch.Generator().manual_seed(rank)), group=group
        )
        return [out]

    def gather(fns):
        out = torch.empty(n * 6, 5)
        fns["all_gather_into_tensor"](out, x, group=group)
        parts = [torch.empty(7, dtype=torch.int64) for _ in range(n)]
        fns["all_gather"](parts, ints, group=group)
        return [out, *parts]

    def bcast(fns):
        t = x.clone()
        fns["broadcast"](t, src=dist.get_process_group_ranks(group or dist.group.WORLD)[-1], group=group)
        fns["barrier"](group=group)
        return [t]

    return [
        ("all_to_all_single", a2a),
        ("all_reduce", reduce),
        ("reduce_scatter_tensor", scatter),
        ("all_gather", gather),
        ("broadcast", bcast),
    ]


def _compare(rank: int, n: int, sub: bool):
    import torch.distributed as dist

    from megarl.engine.megatron.cpu import collectives as cc

    assert cc.install()
    group = dist.new_group([0, n - 1]) if sub else None
    if sub and rank not in (0, n - 1):
        return {}
    members = 2 if sub else n
    shm = {name: getattr(dist, name) for name in cc._orig}
    results = {}
    for name, run in _ops(dist.get_rank(group), members, group):
        mine, ref = run(shm), run(cc._orig)
        results[name] = (mine, ref)
    ch = cc._channels[group or dist.group.WORLD]
    assert ch is not None and ch.seq >= 11, "the ops did not go through shared memory"
    return results


@pytest.mark.parametrize("n,sub,slot", [(2, False, None), (3, False, None), (3, True, None), (3, False, 64)])
def test_shared_memory_collectives_match_gloo(monkeypatch, n, sub, slot):
    """slot 64 bytes: the all-reduces, reduce-scatters and all-gathers go in rounds, the rest
    overflows to gloo."""
    monkeypatch.setenv("MEGARL_CPU_COLLECTIVES", "shm")
    if slot:
        monkeypatch.setenv("MEGARL_CPU_COLLECTIVES_MB", str(slot / (1 << 20)))
    for rank, res in enumerate(run_ranks(_compare, n, n, sub, timeout=120)):
        for name, (mine, ref) in res.items():
            for a, b in zip(mine, ref):
                if n == 2 or sub:
                    assert torch.equal(a, b), (rank, name)
                else:
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _over_the_slot(rank: int, n: int):
    import torch.distributed as dist

    from megarl.engine.megatron.cpu import collectives as cc

    cc.install()
    out = {}
    big = torch.arange(2000, dtype=torch.float32) * (rank + 1)  # 8 KB: 8 rounds of the 1 KB slot
    dist.all_reduce(big)
    out["all_reduce"] = big
    seq0 = cc._channels[dist.group.WORLD].seq
    shard = torch.empty(700)  # 2 x 700 floats: 6 rounds of 128 columns
    dist.reduce_scatter_tensor(shard, torch.arange(1400, dtype=torch.float32) + rank)
    out["reduce_scatter_tensor"] = shard
    gathered = torch.empty(2, 300)  # 2 rounds of 256
    dist.all_gather_into_tensor(gathered, torch.arange(300, dtype=torch.float32) * (rank + 1))
    out["all_gather_into_tensor"] = gathered
    seq1 = cc._channels[dist.group.WORLD].seq
    rows = torch.arange(600, dtype=torch.float32).view(300, 2) + 1000 * rank  # an all-to-all over it: gloo
    swapped = torch.empty(300, 2)
    dist.all_to_all_single(swapped, rows)
    out["all_to_all_single"] = swapped
    small = torch.ones(4) * (rank + 1)
    dist.all_reduce(small)  # through shared memory
    out["small"] = small
    shard3 = torch.empty(3)
    with dist._coalescing_manager(async_ops=False):  # recorded for gloo, not run here
        dist.reduce_scatter_tensor(shard3, torch.arange(6, dtype=torch.float32) + rank)
    out["coalesced"] = shard3
    return out, (seq0, seq1, cc._channels[dist.group.WORLD].seq)


def test_tensors_over_the_slot_go_in_rounds_and_the_rest_takes_gloo(monkeypatch):
    monkeypatch.setenv("MEGARL_CPU_COLLECTIVES", "shm")
    monkeypatch.setenv("MEGARL_CPU_COLLECTIVES_MB", str(1 / 1024))
    for rank, (out, seqs) in enumerate(run_ranks(_over_the_slot, 2, 2, timeout=120)):
        assert torch.equal(out["all_reduce"], torch.arange(2000, dtype=torch.float32) * 3)
        assert torch.equal(out["reduce_scatter_tensor"], (torch.arange(700, dtype=torch.float32) + 700 * rank) * 2 + 1)
        assert torch.equal(out["all_gather_into_tensor"], torch.stack([torch.arange(300.0), torch.arange(300.0) * 2]))
        expect = torch.cat([torch.arange(300.0).view(150, 2) + 300 * rank + 1000 * p for p in range(2)])
        assert torch.equal(out["all_to_all_single"], expect)
        assert torch.equal(out["small"], torch.full((4,), 3.0))
        assert torch.equal(out["coalesced"], torch.arange(3, dtype=torch.float32) * 2 + 1 + 6 * rank)
        # 8 rounds; 6 + 2 rounds; then the overflowed all-to-all's post and the small all-reduce
        assert seqs == (8, 16, 18)


def _auto_oversubscribed(rank: int, n: int):
    import torch.distributed as dist

    from megarl.engine.megatron.cpu import collectives as cc

    cc.install()
    os.cpu_count = lambda: 1  # more ranks than cores: spinning would steal the peers' time
    t = torch.ones(2)
    dist.all_reduce(t)
    return t, cc._channels[dist.group.WORLD]


def test_auto_keeps_gloo_when_ranks_outnumber_cores(monkeypatch):
    monkeypatch.setenv("MEGARL_CPU_COLLECTIVES", "auto")
    for t, ch in run_ranks(_auto_oversubscribed, 2, 2, timeout=120):
        assert torch.equal(t, torch.full((2,), 2.0)) and ch is None


def _mixed_wishes(rank: int, n: int):
    import torch.distributed as dist

    from megarl.engine.megatron.cpu import collectives as cc

    os.environ["MEGARL_CPU_COLLECTIVES"] = "gloo" if rank == 0 else "shm"
    cc.install()
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t)
    return t, cc._channels[dist.group.WORLD]


def test_a_rank_that_wants_gloo_keeps_the_group_on_gloo():
    for t, ch in run_ranks(_mixed_wishes, 2, 2, timeout=120):
        assert torch.equal(t, torch.full((2,), 3.0)) and ch is None


def _peer_dies(rank: int, n: int):
    import torch.distributed as dist

    from megarl.engine.megatron.cpu import collectives as cc

    cc.install()
    dist.all_reduce(torch.ones(1))  # both: the channel opens
    if rank == 1:
        os._exit(3)
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_dead_peer_is_named(monkeypatch):
    monkeypatch.setenv("MEGARL_CPU_COLLECTIVES", "shm")
    message = run_ranks(_peer_dies, 2, 2, timeout=120, may_die=(1,))[0]
    assert "all_reduce" in message and "rank 1" in message and "exited" in message, message
