"""The reshard plan (megarl/bridge/plan.py): pure, no processes.

Hand-checked small cases first, then the invariants on randomized layouts, checked the strongest
way available without processes: `execute` carries a plan out with real tensors (each sender packs
its messages from its own piece, each receiver unpacks the engine request that `request_for`
builds) and every rollout shard must come out equal to its slice of the full tensor, each element
written exactly once. Last, a Qwen3-MoE-like model from Megatron TP=2 x EP=2 to a tp=2 engine whose
layout comes from the embedded server's own `parameter_layout`, against hand-computed byte counts.
"""

from __future__ import annotations

import gc
import json
import math
import random

import pytest
import torch

from megarl.bridge.plan import ALIGN, SourcePiece, TensorSource, box_numel, dest_boxes, itemsize, plan_reshard

MiB = 1 << 20


# ---- helpers ---------------------------------------------------------------------------------------
def whole(shape):
    return tuple((0, s) for s in shape)


def split(shape, dim, parts, index):
    """Box `index` of `parts` equal blocks along `dim`."""
    size = shape[dim] // parts
    return tuple((index * size, (index + 1) * size) if d == dim else (0, s) for d, s in enumerate(shape))


def sharded(name, shape, dim, ranks, dtype="float32", replicas=1):
    """`name` split along `dim` over len(ranks) // replicas blocks, block i on ranks[i::blocks]
    (dim None: whole on every rank)."""
    if dim is None:
        return TensorSource(name, shape, dtype, tuple(SourcePiece(r, whole(shape)) for r in ranks))
    blocks = len(ranks) // replicas
    return TensorSource(
        name, shape, dtype, tuple(SourcePiece(r, split(shape, dim, blocks, i % blocks)) for i, r in enumerate(ranks))
    )


def engine_layout(tensors: dict, tp: int) -> dict:
    """An engine's /get_parallelism_config answer: tensors maps name -> (shape, split dim or None)."""
    ranks = []
    for rank in range(tp):
        params = {}
        for name, (shape, dim) in tensors.items():
            dim = dim if tp > 1 else None
            box = whole(shape) if dim is None else split(shape, dim, tp, rank)
            params[name] = {
                "global_shape": list(shape),
                "dim": dim,
                "range": None if dim is None else list(box[dim]),
                "local_shape": [b - a for a, b in box],
            }
        ranks.append({"rank": rank, "node_rank": 0, "params": params})
    return {"tp_size": tp, "nnodes": 1, "ranks": ranks}


def slices(box):
    return tuple(slice(a, b) for a, b in box)


def full_tensors(sources, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=gen).to(getattr(torch, s.dtype)) for s in sources}


def execute(plan, sources, layouts):
    """Carry the plan out with real tensors; every shard must equal its slice, written exactly once."""
    fulls = full_tensors(sources)
    local = {(p.rank, s.name): fulls[s.name][slices(p.box)] for s in sources for p in s.pieces}
    wire = {}
    for message in plan.messages:  # the senders: pack each message from the sender's own pieces
        buf = torch.zeros(message.nbytes, dtype=torch.uint8)
        for entry in message.entries:
            part = local[(message.src_rank, entry.name)][slices(entry.src_box_local)].contiguous()
            assert part.numel() * part.element_size() == entry.nbytes
            buf[entry.offset : entry.offset + entry.nbytes] = part.reshape(-1).view(torch.uint8)
        wire[(message.src_rank, message.engine, message.dst_rank, message.tag)] = buf
    for e, layout in enumerate(layouts):  # the receivers: only what the engine request says
        request = json.loads(json.dumps(plan.request_for(e)))
        for rank, (boxes, messages) in enumerate(zip(dest_boxes(layout), request, strict=True)):
            shards = {
                name: torch.zeros([b - a for a, b in box], dtype=fulls[name].dtype) for name, box in boxes.items()
            }
            writes = {name: torch.zeros(shard.shape, dtype=torch.int32) for name, shard in shards.items()}
            for message in messages:
                buf = wire.pop((message["src"], e, rank, message["tag"]))
                assert buf.numel() == message["nbytes"]
                for entry in message["entries"]:
                    dtype, shape = getattr(torch, entry["dtype"]), [b - a for a, b in entry["box"]]
                    n = math.prod(shape) * itemsize(entry["dtype"])
                    view = buf[entry["offset"] : entry["offset"] + n].view(dtype).reshape(shape)
                    shards[entry["name"]][slices(entry["box"])] = view
                    writes[entry["name"]][slices(entry["box"])] += 1
            for name, box in boxes.items():
                assert bool((writes[name] == 1).all()), f"engine {e} rank {rank} {name}: not written exactly once"
                assert torch.equal(shards[name], fulls[name][slices(box)]), f"engine {e} rank {rank} {name}"
    assert not wire, f"messages nobody receives: {sorted(wire)}"


def check_buckets(plan, bucket_bytes):
    tags = {}
    for m in plan.messages:
        assert m.entries
        assert m.nbytes <= bucket_bytes or len(m.entries) == 1, m
        end = 0
        for entry in m.entries:
            assert entry.offset % ALIGN == 0 and entry.offset >= end, m
            assert entry.nbytes == box_numel(entry.dst_box_local) * itemsize(entry.dtype)
            assert box_numel(entry.src_box_local) == box_numel(entry.dst_box_local)
            end = entry.offset + entry.nbytes
        assert m.nbytes == end
        tags.setdefault((m.src_rank, m.engine, m.dst_rank), []).append(m.tag)
    for pair, got in tags.items():
        assert sorted(got) == list(range(len(got))), pair


def shard_bytes(layout, rank, dtypes):
    params = layout["ranks"][rank]["params"]
    return sum(math.prod(p["local_shape"]) * itemsize(dtypes[name]) for name, p in params.items())


# ---- hand-checked cases ----------------------------------------------------------------------------
def transfers_of(plan):
    return [(t.name, t.src_rank, t.engine, t.dst_rank, t.box, t.src_local, t.dst_local) for t in plan.transfers]


def test_colwise_tp2_source_to_one_rank_and_to_four_ranks():
    source = sharded("w", (8, 4), 0, [0, 1])  # rank 0 rows 0-4, rank 1 rows 4-8
    plan = plan_reshard([source], [engine_layout({"w": ((8, 4), 0)}, 1)], MiB)
    assert transfers_of(plan) == [
        ("w", 0, 0, 0, ((0, 4), (0, 4)), ((0, 4), (0, 4)), ((0, 4), (0, 4))),
        ("w", 1, 0, 0, ((4, 8), (0, 4)), ((0, 4), (0, 4)), ((4, 8), (0, 4))),
    ]
    assert plan.bytes_received(0, 0) == plan.total_bytes == 8 * 4 * 4
    assert plan.bytes_sent(0) == plan.bytes_sent(1) == 64
    [from0], [from1] = plan.sends_of(0), plan.sends_of(1)
    assert (from0.entries[0].offset, from0.nbytes, from1.nbytes) == (0, 64, 64)
    assert plan.receives_of(0, 0) == [from0, from1]

    plan = plan_reshard([source], [engine_layout({"w": ((8, 4), 0)}, 4)], MiB)
    assert transfers_of(plan) == [
        ("w", d // 2, 0, d, ((2 * d, 2 * d + 2), (0, 4)), ((2 * d % 4, 2 * d % 4 + 2), (0, 4)), ((0, 2), (0, 4)))
        for d in range(4)
    ]
    assert [plan.bytes_received(0, d) for d in range(4)] == [32] * 4
    execute(plan, [source], [engine_layout({"w": ((8, 4), 0)}, 4)])


def test_rowwise_source_to_colwise_dest():
    source = sharded("o", (4, 8), 1, [0, 1])  # rank 0 columns 0-4, rank 1 columns 4-8
    layout = engine_layout({"o": ((4, 8), 0)}, 2)  # rank 0 rows 0-2, rank 1 rows 2-4
    plan = plan_reshard([source], [layout], MiB)
    assert transfers_of(plan) == [
        ("o", 0, 0, 0, ((0, 2), (0, 4)), ((0, 2), (0, 4)), ((0, 2), (0, 4))),
        ("o", 1, 0, 0, ((0, 2), (4, 8)), ((0, 2), (0, 4)), ((0, 2), (4, 8))),
        ("o", 0, 0, 1, ((2, 4), (0, 4)), ((2, 4), (0, 4)), ((0, 2), (0, 4))),
        ("o", 1, 0, 1, ((2, 4), (4, 8)), ((2, 4), (0, 4)), ((0, 2), (4, 8))),
    ]
    assert plan.bytes_received(0, 0) == plan.bytes_received(0, 1) == 2 * 8 * 4
    execute(plan, [source], [layout])


def test_replicas_share_the_sending_evenly():
    # two data-parallel copies of every tensor: each copy sends half
    sources = [sharded(f"w{i}", (8, 8), None, [0, 1]) for i in range(4)]
    split_dest = engine_layout({s.name: ((8, 8), 0) for s in sources}, 2)
    plan = plan_reshard(sources, [split_dest], MiB)
    assert [(t.src_rank, t.dst_rank) for t in plan.transfers] == [(0, 0), (1, 1)] * 4
    whole_dest = engine_layout({s.name: ((8, 8), None) for s in sources}, 1)
    plan = plan_reshard(sources, [whole_dest], MiB)
    assert [t.src_rank for t in plan.transfers] == [0, 1, 0, 1]
    assert plan.bytes_sent(0) == plan.bytes_sent(1) == 2 * 8 * 8 * 4
    execute(plan, sources, [whole_dest])


def test_experts_owned_whole_by_different_ranks():
    experts = [sharded(f"experts.{e}.w", (4, 6), None, [e // 2]) for e in range(4)]  # 0,1 on rank 0
    layout = engine_layout({s.name: ((4, 6), 0) for s in experts}, 2)
    plan = plan_reshard(experts, [layout], MiB)
    assert [(t.name, t.src_rank, t.dst_rank, t.src_local) for t in plan.transfers] == [
        (f"experts.{e}.w", e // 2, d, ((2 * d, 2 * d + 2), (0, 6))) for e in range(4) for d in range(2)
    ]
    assert plan.bytes_sent(0) == plan.bytes_sent(1) == 2 * 4 * 6 * 4
    # one message per (sender, receiver), both of the sender's experts in it, 16-aligned
    for src in (0, 1):
        assert [(m.dst_rank, [x.offset for x in m.entries], m.nbytes) for m in plan.sends_of(src)] == [
            (src, [0, 48], 96),
            (1 - src, [0, 48], 96),
        ]  # each sender starts at its own receiver
    execute(plan, experts, [layout])


def test_tied_names_are_delivered_under_each_name_and_json_boxes_are_accepted():
    pieces = [SourcePiece(r, [[4 * r, 4 * r + 4], [0, 4]]) for r in (0, 1)]  # as they come out of JSON
    sources = [TensorSource(name, [8, 4], "bfloat16", pieces) for name in ("embed.weight", "lm_head.weight")]
    layout = engine_layout({"embed.weight": ((8, 4), 0), "lm_head.weight": ((8, 4), 0)}, 2)
    plan = plan_reshard(sources, [layout], MiB)
    assert [(t.name, t.src_rank, t.dst_rank) for t in plan.transfers] == [
        ("embed.weight", 0, 0),
        ("embed.weight", 1, 1),
        ("lm_head.weight", 0, 0),
        ("lm_head.weight", 1, 1),
    ]
    execute(plan, sources, [layout])


def test_buckets_bound_pack_align_and_split_big_boxes_along_dim0():
    small = [sharded(f"s{i}", (10,), None, [0]) for i in range(3)]  # 40 bytes each
    plan = plan_reshard(small, [engine_layout({s.name: ((10,), None) for s in small}, 1)], 100)
    assert [([x.offset for x in m.entries], m.nbytes, m.tag) for m in plan.messages] == [([0, 48], 88, 0), ([0], 40, 1)]

    big = [sharded("big", (10, 4), None, [0]), sharded("after", (2,), None, [0])]  # 160 + 8 bytes
    layouts = [engine_layout({"big": ((10, 4), None), "after": ((2,), None)}, 1)]
    plan = plan_reshard(big, layouts, 64)  # 4 rows of 16 bytes per bucket
    assert [[(x.name, x.dst_box_local, x.offset) for x in m.entries] for m in plan.messages] == [
        [("big", ((0, 4), (0, 4)), 0)],
        [("big", ((4, 8), (0, 4)), 0)],
        [("big", ((8, 10), (0, 4)), 0), ("after", ((0, 2),), 32)],
    ]
    assert len(plan.transfers) == 2  # split for the wire only
    execute(plan, big, layouts)

    wide = [sharded("wide", (2, 100), None, [0])]  # one row is 400 bytes: travels alone
    plan = plan_reshard(wide, [engine_layout({"wide": ((2, 100), None)}, 1)], 64)
    assert [(m.entries[0].dst_box_local, m.nbytes) for m in plan.messages] == [
        (((0, 1), (0, 100)), 400),
        (((1, 2), (0, 100)), 400),
    ]


def test_request_for_is_json_and_matches_receives_of():
    sources = [sharded("a", (8, 4), 0, [0, 1]), sharded("b", (4,), None, [0, 1, 2])]
    layouts = [engine_layout({"a": ((8, 4), 0), "b": ((4,), None)}, 2), engine_layout({"a": ((8, 4), 1)}, 4)]
    plan = plan_reshard(sources, layouts, MiB)
    request = plan.request_for(1)
    assert json.loads(json.dumps(request)) == request
    assert len(request) == 4
    for rank, messages in enumerate(request):
        assert messages == [
            {
                "src": m.src_rank,
                "tag": m.tag,
                "nbytes": m.nbytes,
                "entries": [
                    {"name": x.name, "dtype": x.dtype, "box": [list(p) for p in x.dst_box_local], "offset": x.offset}
                    for x in m.entries
                ],
            }
            for m in plan.receives_of(1, rank)
        ]
    assert request[3] == [  # column 3: rows 0-4 from rank 0, rows 4-8 from rank 1
        {
            "src": src,
            "tag": 0,
            "nbytes": 16,
            "entries": [{"name": "a", "dtype": "float32", "box": [[4 * src, 4 * src + 4], [0, 1]], "offset": 0}],
        }
        for src in (0, 1)
    ]


def test_same_inputs_same_plan_whatever_the_order_of_ranks_and_params():
    sources = [sharded("a", (8, 4), 0, [0, 1, 2, 3], replicas=2), sharded("b", (6,), None, [0, 1, 2, 3])]
    layout = engine_layout({"a": ((8, 4), 1), "b": ((6,), None)}, 2)
    shuffled = {
        **layout,
        "ranks": [{**r, "params": dict(reversed(r["params"].items()))} for r in reversed(layout["ranks"])],
    }
    plans = [plan_reshard(sources, [layout], 40), plan_reshard(sources, [shuffled], 40)]
    assert plans[0] == plans[1] and plans[0].transfers == plans[1].transfers
    assert gc.isenabled()


# ---- errors ----------------------------------------------------------------------------------------
def piece(rank, *box):
    return SourcePiece(rank, box)


@pytest.mark.parametrize(
    "pieces, match",
    [
        ((piece(0, (0, 4)), piece(1, (5, 8))), "w: the trainer pieces cover 7 of its 8 elements"),
        ((piece(0, (0, 5)), piece(1, (4, 8))), "w: trainer boxes .* overlap"),
        ((piece(0, (0, 4)), piece(1, (4, 9))), r"w: trainer rank 1's box \(\(4, 9\),\) is not within"),
        ((piece(0, (0, 8), (0, 1)),), "is not within the tensor's shape"),
        ((piece(0, (0, 4)), piece(0, (4, 8))), "w: trainer rank 0 lists two boxes"),
        ((), "w: no trainer rank holds any of it"),
    ],
)
def test_bad_sources_are_named(pieces, match):
    layout = engine_layout({"w": ((8,), None)}, 1)
    with pytest.raises(ValueError, match=match):
        plan_reshard([TensorSource("w", (8,), "float32", pieces)], [layout], MiB)


def test_name_and_shape_mismatches_are_named():
    w = sharded("w", (8, 4), 0, [0, 1])
    with pytest.raises(ValueError, match="engine 0 rank 0 holds lm_head.weight but no trainer rank exports"):
        plan_reshard([w], [engine_layout({"w": ((8, 4), 0), "lm_head.weight": ((8, 4), 0)}, 2)], MiB)
    with pytest.raises(ValueError, match="the trainer exports extra but no engine holds them"):
        plan_reshard([w, sharded("extra", (2,), None, [0])], [engine_layout({"w": ((8, 4), 0)}, 2)], MiB)
    with pytest.raises(ValueError, match=r"w: engine 0 rank 0 has global_shape \[8, 8\] but the trainer exports"):
        plan_reshard([w], [engine_layout({"w": ((8, 8), 0)}, 2)], MiB)
    with pytest.raises(ValueError, match="w: listed twice"):
        plan_reshard([w, w], [engine_layout({"w": ((8, 4), 0)}, 2)], MiB)
    with pytest.raises(ValueError, match="dtype 'torch.float32' is not a torch dtype name"):
        plan_reshard(
            [TensorSource("w", (8, 4), "torch.float32", w.pieces)], [engine_layout({"w": ((8, 4), 0)}, 2)], MiB
        )
    bad_range = engine_layout({"w": ((8, 4), 0)}, 2)
    bad_range["ranks"][1]["params"]["w"]["range"] = [4, 9]
    with pytest.raises(ValueError, match=r"w on engine 0 rank 1: dim 0 range \[4, 9\) is outside"):
        plan_reshard([w], [bad_range], MiB)
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        plan_reshard([w], [engine_layout({"w": ((8, 4), 0)}, 2)], 0)


# ---- invariants on randomized layouts --------------------------------------------------------------
def random_tiling(shape, rng):
    """Up to 4 boxes tiling `shape`: uneven cuts along one or two dims."""
    cuts = []
    for s in shape:
        inner = sorted(rng.sample(range(1, s), min(s - 1, rng.choice([0, 0, 1, 2])))) if s > 1 else []
        cuts.append([0, *inner, s])
    while math.prod(len(c) - 1 for c in cuts) > 4:
        cuts[max(range(len(cuts)), key=lambda d: len(cuts[d]))].pop(1)
    boxes = [()]
    for c in cuts:
        boxes = [b + ((a, z),) for b in boxes for a, z in zip(c, c[1:])]
    return boxes


def random_case(rng):
    world, sources, tensors = 8, [], {}
    for i in range(rng.randint(1, 5)):
        shape = tuple(rng.choice([1, 2, 3, 4, 6, 8, 12]) for _ in range(rng.randint(1, 3)))
        ranks = rng.sample(range(world), world)
        pieces = []
        for box in random_tiling(shape, rng):
            pieces += [SourcePiece(ranks.pop(), box) for _ in range(rng.randint(1, 2))]
        sources.append(TensorSource(f"t{i}", shape, rng.choice(["float32", "bfloat16", "int64"]), tuple(pieces)))
        tensors[f"t{i}"] = shape
    layouts = []
    for _ in range(rng.randint(1, 3)):
        tp = rng.choice([1, 2, 3, 4])
        dims = {
            name: rng.choice([None] + [d for d, s in enumerate(shape) if s % tp == 0])
            for name, shape in tensors.items()
        }
        layouts.append(engine_layout({name: (tensors[name], dims[name]) for name in tensors}, tp))
    return sources, layouts, rng.choice([16, 48, 100, 256, MiB])


@pytest.mark.parametrize("seed", range(150))
def test_randomized_layouts_deliver_exactly_each_shard(seed):
    sources, layouts, bucket_bytes = random_case(random.Random(seed))
    plan = plan_reshard(sources, layouts, bucket_bytes)
    execute(plan, sources, layouts)
    check_buckets(plan, bucket_bytes)
    dtypes = {s.name: s.dtype for s in sources}
    for e, layout in enumerate(layouts):
        for rank in range(len(layout["ranks"])):
            assert plan.bytes_received(e, rank) == shard_bytes(layout, rank, dtypes)
            assert plan.bytes_received(e, rank) == sum(x.nbytes for m in plan.receives_of(e, rank) for x in m.entries)
    full_bytes = {s.name: math.prod(s.shape) * itemsize(s.dtype) for s in sources}
    tp = [len(layout["ranks"]) for layout in layouts]
    replicated = sum(
        full_bytes[name] * (n - 1)
        for layout, n in zip(layouts, tp)
        for name, p in layout["ranks"][0]["params"].items()
        if p["dim"] is None
    )
    assert plan.total_bytes == sum(full_bytes.values()) * len(layouts) + replicated
    assert plan.total_bytes == sum(plan.bytes_sent(r) for r in range(8)) == sum(t.nbytes for t in plan.transfers)
    assert plan == plan_reshard(sources, layouts, bucket_bytes)


# ---- a Qwen3-MoE-like model: Megatron TP=2 x EP=2 -> a tp=2 engine ----------------------------------
L, E, H, HEADS, KV, HD, I, V = 4, 8, 64, 4, 2, 16, 32, 128  # layers, experts, hidden, ..., vocab


def qwen3_moe_shapes():
    shapes = {"model.embed_tokens.weight": (V, H)}
    for layer in range(L):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "self_attn.q_proj.weight": (HEADS * HD, H),
            p + "self_attn.k_proj.weight": (KV * HD, H),
            p + "self_attn.v_proj.weight": (KV * HD, H),
            p + "self_attn.o_proj.weight": (H, HEADS * HD),
            p + "self_attn.q_norm.weight": (HD,),
            p + "self_attn.k_norm.weight": (HD,),
            p + "mlp.gate.weight": (E, H),
        }
        for e in range(E):
            shapes |= {
                p + f"mlp.experts.{e}.gate_proj.weight": (I, H),
                p + f"mlp.experts.{e}.up_proj.weight": (I, H),
                p + f"mlp.experts.{e}.down_proj.weight": (H, I),
            }
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    return shapes | {"model.norm.weight": (H,), "lm_head.weight": (V, H)}


def megatron_tp2_ep2_sources(shapes):
    """World 4. Dense: tp = rank % 2, dp = rank // 2 (two replicas of each TP block); column-parallel
    (q/k/v, vocab) split rows, row-parallel (o_proj) split columns, norms and the router whole on
    every rank. Experts (expert-TP 1): ep = rank % 2 owns experts ep*4 .. ep*4+3 whole, edp = rank // 2
    holds a second copy."""
    sources = []
    for name, shape in shapes.items():
        if ".experts." in name:
            ep = int(name.split(".experts.")[1].split(".")[0]) // (E // 2)
            sources.append(sharded(name, shape, None, [ep, ep + 2], "bfloat16"))
        elif any(k in name for k in ("q_proj", "k_proj", "v_proj", "embed_tokens", "lm_head")):
            sources.append(sharded(name, shape, 0, [0, 1, 2, 3], "bfloat16", replicas=2))
        elif "o_proj" in name:
            sources.append(sharded(name, shape, 1, [0, 1, 2, 3], "bfloat16", replicas=2))
        else:
            sources.append(sharded(name, shape, None, [0, 1, 2, 3], "bfloat16"))
    return sources


def test_qwen3_moe_megatron_tp2_ep2_to_a_tp2_engine():
    from transformers import Qwen3MoeConfig

    from megarl.rollout.engine.runner.sharding import parameter_layout, tp_plan_for

    shapes = qwen3_moe_shapes()
    layout = parameter_layout(shapes, tp_plan_for(Qwen3MoeConfig()), 2)
    sources = megatron_tp2_ep2_sources(shapes)
    plan = plan_reshard(sources, [layout], 64 * 1024)

    # by hand, in elements: per layer, split across the 2 engine ranks: q 4096 + k 2048 + v 2048 +
    # o 4096 + 8 experts x 3 x 2048 = 61440; whole on each: norms 16 + 16 + 64 + 64 + router 512 = 672;
    # embed 8192 + lm_head 8192 split, final norm 64 whole. bf16: 2 bytes.
    per_rank = 2 * (L * (61440 // 2 + 672) + 8192 + 64)
    assert per_rank == 267648
    assert plan.bytes_received(0, 0) == plan.bytes_received(0, 1) == per_rank
    full_model = 2 * (L * (61440 + 672) + 2 * 8192 + 64)
    assert plan.total_bytes == 2 * per_rank == full_model + 2 * (L * 672 + 64)  # norms/router reach both ranks

    # experts come only from their EP owners, each half of them from each expert-DP copy
    expert_bytes = {
        r: sum(t.nbytes for t in plan.transfers if t.src_rank == r and ".experts." in t.name) for r in range(4)
    }
    assert expert_bytes[0] + expert_bytes[2] == expert_bytes[1] + expert_bytes[3] == 2 * L * 4 * 3 * 2048
    assert all(
        int(t.name.split(".experts.")[1].split(".")[0]) // 4 == t.src_rank % 2
        for t in plan.transfers
        if ".experts." in t.name
    )
    # the greedy choice keeps the four senders within one transfer of each other
    largest = max(t.nbytes for t in plan.transfers)
    assert max(plan.bytes_sent(r) for r in range(4)) - min(plan.bytes_sent(r) for r in range(4)) <= largest
    assert sum(plan.bytes_sent(r) for r in range(4)) == 2 * per_rank
    check_buckets(plan, 64 * 1024)
    execute(plan, sources, [layout])
