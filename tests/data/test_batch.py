"""Batch: every operation, its length checks, and cheap pickling."""

import pickle

import numpy as np
import pytest
import torch

from megarl.data.batch import Batch, BatchError, as_object_array

torch.set_num_threads(1)


def make(n=5):
    return Batch(
        tensors={"ids": torch.arange(n * 3).view(n, 3), "score": torch.arange(n, dtype=torch.float32)},
        non_tensors={"uid": [f"u{i}" for i in range(n)], "prompt_ids": [[i] * (i + 1) for i in range(n)]},
        meta={"temperature": 1.0},
    )


def test_construction_and_columns():
    b = make()
    assert len(b) == 5
    assert b.keys() == ["ids", "score", "uid", "prompt_ids"]
    assert "uid" in b and "nope" not in b
    assert b["uid"].dtype == object and b["uid"].shape == (5,)
    # a list of equally long lists stays one list per row, not a 2-D array
    assert b["prompt_ids"][2] == [2, 2, 2]
    same_len = as_object_array([[1, 2], [3, 4]])
    assert same_len.shape == (2,) and same_len[1] == [3, 4]
    assert len(Batch()) == 0


def test_length_mismatch_rejected_everywhere():
    with pytest.raises(BatchError, match="different lengths"):
        Batch({"a": torch.zeros(3)}, {"b": [1, 2]})
    b = make()
    with pytest.raises(BatchError, match="'new' has 4 rows but the batch has 5"):
        b["new"] = torch.zeros(4)
    with pytest.raises(BatchError, match="has 2 rows"):
        b["x"] = ["a", "b"]
    with pytest.raises(BatchError, match="cannot union batches of 5 and 2"):
        b.union(Batch({"z": torch.zeros(2)}))
    with pytest.raises(BatchError, match="0-dimensional"):
        Batch({"a": torch.tensor(1.0)})
    with pytest.raises(BatchError, match="both tensor and non-tensor"):
        Batch({"a": torch.zeros(2)}, {"a": [1, 2]})


def test_setitem_adds_and_replaces_across_kinds():
    b = make()
    b["reward"] = torch.ones(5)
    assert torch.equal(b["reward"], torch.ones(5))
    b["reward"] = ["r"] * 5  # replacing with a non-tensor column moves the key
    assert "reward" not in b.tensors and list(b["reward"]) == ["r"] * 5
    empty = Batch()
    empty["a"] = torch.zeros(7)
    assert len(empty) == 7


def test_select_pop_and_missing_key_message():
    b = make()
    s = b.select("ids", "uid")
    assert s.keys() == ["ids", "uid"] and s.meta == {"temperature": 1.0}
    assert "score" in b  # select does not mutate
    popped = b.pop("score", "prompt_ids")
    assert popped.keys() == ["score", "prompt_ids"]
    assert b.keys() == ["ids", "uid"]
    with pytest.raises(KeyError, match=r"no column\(s\) \['missing'\]; it has \['ids', 'uid'\]"):
        b.select("missing")
    with pytest.raises(KeyError, match="missing"):
        b["missing"]


def test_union_merges_and_detects_conflicts():
    b = make()
    other = Batch({"adv": torch.ones(5)}, {"tag": list("abcde")}, {"step": 3})
    u = b.union(other)
    assert set(u.keys()) == {"ids", "score", "uid", "prompt_ids", "adv", "tag"}
    assert u.meta == {"temperature": 1.0, "step": 3}
    assert "adv" not in b  # inputs untouched
    # identical shared columns are fine
    assert b.union(b.select("ids", "uid")).keys() == b.keys()
    with pytest.raises(BatchError, match="tensor column 'score'"):
        b.union(Batch({"score": torch.zeros(5)}))
    with pytest.raises(BatchError, match="non-tensor column 'uid'"):
        b.union(Batch(non_tensors={"uid": ["x"] * 5}))
    with pytest.raises(BatchError, match="meta 'temperature'"):
        b.union(Batch(meta={"temperature": 0.5}))
    with pytest.raises(BatchError, match="tensor column 'uid'"):
        b.union(Batch({"uid": torch.zeros(5)}))


def test_chunk_sizes_order_and_concat_roundtrip():
    b = make(7)
    pieces = b.chunk(3)
    assert [len(p) for p in pieces] == [3, 2, 2]
    assert torch.equal(torch.cat([p["score"] for p in pieces]), b["score"])
    back = Batch.concat(pieces)
    assert torch.equal(back["ids"], b["ids"])
    assert list(back["uid"]) == list(b["uid"])
    assert back["prompt_ids"][6] == [6] * 7
    assert [len(p) for p in make(2).chunk(4)] == [1, 1, 0, 0]
    with pytest.raises(BatchError, match="n >= 1"):
        b.chunk(0)


def test_split_sizes():
    parts = make(5).split([1, 0, 4])
    assert [len(p) for p in parts] == [1, 0, 4]
    assert list(parts[2]["uid"]) == ["u1", "u2", "u3", "u4"]
    with pytest.raises(BatchError, match="sum to 5"):
        make(5).split([2, 2])


def test_concat_errors_and_meta():
    a, b = make(2), make(3)
    b.meta = {"temperature": 0.5, "extra": 1}
    c = Batch.concat([a, b])
    assert len(c) == 5 and c.meta == {"temperature": 1.0, "extra": 1}
    with pytest.raises(BatchError, match="batch 1 has columns"):
        Batch.concat([a, a.select("ids")])
    wide = Batch(
        {"ids": torch.zeros(2, 4, dtype=torch.long), "score": torch.zeros(2)},
        {"uid": ["a", "b"], "prompt_ids": [[1], [2]]},
    )
    with pytest.raises(BatchError, match=r"'ids' has different per-row shapes \[\(3,\), \(4,\)\]"):
        Batch.concat([a, wide])
    with pytest.raises(BatchError, match="at least one"):
        Batch.concat([])


@pytest.mark.parametrize(
    "index, rows",
    [
        (2, [2]),
        (-1, [4]),
        (slice(1, 4, 2), [1, 3]),
        ([4, 0, 0], [4, 0, 0]),
        (torch.tensor([3, 1]), [3, 1]),
        (np.array([0, 2]), [0, 2]),
        (torch.tensor([True, False, False, True, True]), [0, 3, 4]),
        ([False] * 5, []),
    ],
)
def test_row_indexing(index, rows):
    b = make()
    sub = b[index]
    assert sub["score"].tolist() == [float(r) for r in rows]
    assert list(sub["uid"]) == [f"u{r}" for r in rows]
    assert sub["ids"].shape == (len(rows), 3)
    assert sub.meta == b.meta


def test_bad_row_indices():
    b = make()
    with pytest.raises(IndexError):
        b[5]
    with pytest.raises(IndexError):
        b[[0, 9]]
    with pytest.raises(BatchError, match="bool row mask has shape"):
        b[torch.tensor([True, False])]
    with pytest.raises(BatchError, match="integer or bool"):
        b[torch.tensor([0.5])]


def test_repeat_interleave():
    b = make(2).repeat_interleave(3)
    assert b["score"].tolist() == [0, 0, 0, 1, 1, 1]
    assert list(b["uid"]) == ["u0"] * 3 + ["u1"] * 3
    assert b["ids"].shape == (6, 3)
    with pytest.raises(BatchError):
        b.repeat_interleave(0)


def test_to_device_keeps_non_tensors():
    b = make().to("cpu")
    moved = make().to(torch.device("meta"))
    assert moved["ids"].device.type == "meta"
    assert list(moved["uid"]) == list(b["uid"])


def test_pickle_roundtrip_and_size_close_to_raw_bytes():
    n, width = 4096, 256
    big = Batch({"x": torch.randn(n, width), "m": torch.ones(n, width, dtype=torch.bool)}, meta={"step": 1})
    raw = n * width * 4 + n * width * 1
    blob = pickle.dumps(big)
    # storage pickling costs a few hundred bytes of headers; a list round trip would cost
    # > 8 bytes per float (~4x raw) and a text encoding far more
    assert raw <= len(blob) < raw * 1.01 + 4096
    back = pickle.loads(blob)
    assert torch.equal(back["x"], big["x"]) and torch.equal(back["m"], big["m"])
    assert back.meta == {"step": 1}


def test_pickled_slice_ships_only_its_rows():
    base = Batch({"x": torch.randn(1000, 100)})
    rows = base[10:20]
    assert rows["x"].untyped_storage().nbytes() == 1000 * 100 * 4  # a view of the base
    blob = pickle.dumps(rows)
    assert len(blob) < 10 * 100 * 4 + 4096
    assert torch.equal(pickle.loads(blob)["x"], base["x"][10:20])
    strided = Batch({"x": torch.randn(100, 50).t()})  # non-contiguous survives the trip
    assert torch.equal(pickle.loads(pickle.dumps(strided))["x"], strided["x"])


def test_pickled_columns_name_no_torch_storage_loader():
    """Columns numpy holds travel as ndarrays: a torch storage's pickle would name the sender's
    `torch.storage._load_from_bytes`, which megatron-core replaces with its own, so the driver
    would import megatron-core to read an actor's answer (see batch._to_wire)."""
    cols = {
        "f32": torch.randn(3, 4),
        "f64": torch.randn(3, 2, dtype=torch.float64),
        "i64": torch.arange(6).view(3, 2),
        "b": torch.tensor([True, False, True]),
        "u8": torch.tensor([1, 2, 255], dtype=torch.uint8),
        "bf16": torch.randn(3, 2).bfloat16(),
    }
    b = Batch(cols)
    plain = Batch({k: v for k, v in cols.items() if k != "bf16"})
    assert b"_load_from_bytes" not in pickle.dumps(plain) and b"torch.storage" not in pickle.dumps(plain)
    buffers = []  # as Ray does it: protocol 5, out-of-band buffers, handed back read-only
    blob = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    back = pickle.loads(blob, buffers=[memoryview(buf.raw()).toreadonly() for buf in buffers])
    for k, v in cols.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    back["f32"][0, 0] = 7.0  # writable (a copy of the read-only buffer), the original untouched
    assert back["f32"][0, 0] == 7.0 and cols["f32"][0, 0] != 7.0
