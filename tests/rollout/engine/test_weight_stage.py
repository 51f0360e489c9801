"""The deferred-update stage and the memory kept across syncs, in one process (no groups, no servers):
commit by swapping spares in, the copy fallback for parameters staged in part, tied names, a refused
or aborted update leaving the parameters untouched, the coverage check, the engines' kept receive
buffer, the reshard sender's packing and the disk sender's clones (only of overlapping tensors).

Values are compared exactly (torch.equal): every path here only copies or rebinds memory. The
processes around these (groups, votes, parity with the trainer within 1e-4 after every sync) are
tests/rollout/engine/test_weight_receive.py and tests/bridge/test_bridge.py.
"""

from __future__ import annotations

import pytest
import torch

from megarl.bridge.reshard import _pack
from megarl.rollout.engine.runner.receive import ReceiveBuffer
from megarl.rollout.engine.runner.stage import Piece, Stage, covered_names


def _model():
    w, b = torch.nn.Parameter(torch.arange(12.0).view(4, 3)), torch.nn.Parameter(torch.zeros(4))
    tensors = {"w": w, "b": b, "tied": w}  # "tied" is the same Parameter as "w", as tied embeddings are
    return tensors, (lambda name: tuple(tensors[name].shape))


def _piece(name, values, box=None):
    return Piece(name, box, lambda: values)


def _commit(stage, version, covered_of=None):
    pieces = stage.take(version)
    covered = covered_names(pieces, covered_of or stage.local_shape)
    leftover = stage.swap_in(pieces, covered)
    with torch.no_grad():
        for p in leftover:
            target = stage.tensors[p.name].data
            (target if p.box is None else target[tuple(slice(a, b) for a, b in p.box)]).copy_(p.read())
    return leftover


def test_whole_parameters_are_swapped_in_and_their_old_memory_is_the_next_spare():
    tensors, shape = _model()
    stage = Stage(tensors, shape)
    w_old_ptr, b_old_ptr = tensors["w"].data_ptr(), tensors["b"].data_ptr()
    new_w, new_b = torch.full((4, 3), 7.0), torch.full((4,), 2.0)
    stage.add("v1", stage.copy([_piece("w", new_w), _piece("b", new_b)]))
    new_w.fill_(-1.0)  # the sender reuses its memory once answered: the stage holds copies
    assert _commit(stage, "v1") == []  # nothing left to copy: both swapped
    assert torch.equal(tensors["w"], torch.full((4, 3), 7.0)) and torch.equal(tensors["b"], new_b)
    assert tensors["w"].data_ptr() != w_old_ptr and tensors["tied"] is tensors["w"]
    # the next sync stages into the memory the parameters had: no fresh allocation
    stage.add("v2", stage.copy([_piece("w", torch.ones(4, 3)), _piece("b", torch.ones(4))]))
    assert {p.read().data_ptr() for p in stage.pieces} == {w_old_ptr, b_old_ptr}
    _commit(stage, "v2")
    assert tensors["w"].data_ptr() == w_old_ptr and torch.equal(tensors["w"], torch.ones(4, 3))


def test_a_parameter_staged_in_part_is_copied_box_by_box_and_keeps_its_memory():
    tensors, shape = _model()
    stage = Stage(tensors, shape)
    ptr = tensors["w"].data_ptr()
    stage.add("v1", stage.copy([_piece("w", torch.full((2, 3), 5.0), ((2, 4), (0, 3)))]))
    leftover = _commit(stage, "v1")
    assert [p.name for p in leftover] == ["w"] and tensors["w"].data_ptr() == ptr
    expected = torch.arange(12.0).view(4, 3)
    expected[2:] = 5.0
    assert torch.equal(tensors["w"].data, expected)


def test_tied_names_swap_once_with_the_last_staged_values():
    tensors, shape = _model()
    stage = Stage(tensors, shape)
    stage.add("v1", stage.copy([_piece("w", torch.full((4, 3), 1.0)), _piece("tied", torch.full((4, 3), 3.0))]))
    _commit(stage, "v1")
    assert torch.equal(tensors["w"].data, torch.full((4, 3), 3.0))  # as two copies in order would leave it


def test_a_refused_or_aborted_update_leaves_the_parameters_untouched():
    tensors, shape = _model()
    stage = Stage(tensors, shape)
    before = tensors["w"].detach().clone()
    stage.copy([_piece("w", torch.zeros(4, 3))])  # copied on this rank, then the vote refused it: not added
    stage.add("v1", stage.copy([_piece("b", torch.ones(4))]))
    assert stage.clear() == 1  # abort
    assert torch.equal(tensors["w"].data, before) and torch.equal(tensors["b"].data, torch.zeros(4))
    with pytest.raises(ValueError, match="nothing is staged"):
        stage.take("v1")


def test_spares_follow_release_and_resume():
    tensors, shape = _model()
    full = {"w": (4, 3), "b": (4,), "tied": (4, 3)}
    stage = Stage(tensors, lambda name: full[name])
    stage.drop_spares()
    tensors["w"].data = torch.empty(0)  # released; a deferred update may still be staged
    stage.add("v1", stage.copy([_piece("w", torch.ones(4, 3))]))
    pieces = stage.take("v1")
    assert stage.swap_in(pieces, ["w"]) == pieces  # not resident: never swapped, the write path reports it
    tensors["w"].data = torch.empty(4, 3)  # resumed
    stage.add("v2", stage.copy([_piece("w", torch.ones(4, 3))]))
    _commit(stage, "v2", lambda name: full[name])
    assert torch.equal(tensors["w"].data, torch.ones(4, 3))


def test_coverage_of_boxes_with_and_without_the_mask():
    shape = lambda name: (4, 6)  # noqa: E731
    halves = [_piece("x", None, ((0, 4), (0, 3))), _piece("x", None, ((0, 4), (3, 6)))]
    assert covered_names(halves, shape) == ["x"]  # disjoint, full volume
    overlapping = [
        _piece("x", None, ((0, 2), (0, 6))),
        _piece("x", None, ((1, 3), (0, 6))),
        _piece("x", None, ((3, 4), (0, 6))),
    ]
    assert covered_names(overlapping[:2] + [_piece("x", None, ((2, 3), (0, 6)))], shape) == []  # row 3 missing
    assert covered_names(overlapping, shape) == ["x"]  # overlapping but complete: counted on the mask
    assert covered_names([_piece("x", None, ((0, 4), (0, 5)))], shape) == []


def test_receive_buffer_is_kept_aligned_and_grows():
    memory = ReceiveBuffer(torch.device("cpu"))
    a, b = memory.carve([10, 100])
    assert (a.numel(), b.numel()) == (10, 100) and b.data_ptr() - a.data_ptr() == ReceiveBuffer.ALIGN
    again = memory.carve([50])[0]
    assert again.data_ptr() == a.data_ptr()  # the same memory, request after request
    bigger = memory.carve([1 << 20])[0]
    assert bigger.numel() == 1 << 20
    assert memory.carve([8])[0].data_ptr() == bigger.data_ptr()
    with pytest.raises(ValueError, match="-1 bytes"):
        memory.carve([-1])


@pytest.mark.parametrize("offset", [16, 3])
def test_reshard_pack_copies_a_strided_box_in_c_order(offset):
    source = torch.arange(48, dtype=torch.float32).view(6, 8)
    part = source[1:5, 2:7]  # not contiguous
    buf = torch.zeros(offset + part.numel() * 4 + 8, dtype=torch.uint8)
    _pack(buf, offset, part)
    got = buf[offset : offset + part.numel() * 4].clone().view(torch.float32).view(part.shape)
    assert torch.equal(got, part) and int(buf[:offset].sum()) == 0 and int(buf[offset + part.numel() * 4 :].sum()) == 0


def test_disk_clones_only_tensors_that_overlap_and_safetensors_takes_the_rest(tmp_path):
    from safetensors.torch import load_file, save_file

    from megarl.bridge.disk import _without_overlaps

    fused, emb = torch.arange(30.0).view(10, 3), torch.randn(4, 3)
    named = {"q": fused[:4], "k": fused[4:7], "v": fused[7:], "emb": emb, "head": emb, "inside": fused[2:5]}
    out = _without_overlaps(dict(named))
    shares = {
        name: t.untyped_storage().data_ptr() == named[name].untyped_storage().data_ptr() for name, t in out.items()
    }
    assert shares == {"q": True, "k": True, "v": True, "emb": True, "head": False, "inside": False}
    save_file(out, tmp_path / "m.safetensors")  # refuses overlapping tensors: none are left
    back = load_file(tmp_path / "m.safetensors")
    assert all(torch.equal(back[name], t) for name, t in named.items())
