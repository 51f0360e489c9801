"""Dispatch modes and mesh validation, with hand-built Megatron meshes (no Ray)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megarl.controller.decorator import Registration, register, registration_of
from megarl.controller.dispatch import (
    Dispatch,
    MeshCoord,
    MeshError,
    collect_outputs,
    dp_output_ranks,
    split_args,
    validate_mesh,
)
from megarl.data.batch import Batch

torch.set_num_threads(1)


def dp_mesh(world: int) -> list[MeshCoord]:
    return [MeshCoord(rank=r, dp_rank=r, dp_size=world) for r in range(world)]


# tp=2, pp=2, dp=2 in Megatron's default rank order (tp fastest, then dp, then pp), written out
# by hand rather than generated, so the test does not share a formula with the code under test.
TP2_PP2_DP2 = [
    MeshCoord(rank=0, tp_rank=0, tp_size=2, dp_rank=0, dp_size=2, pp_rank=0, pp_size=2),
    MeshCoord(rank=1, tp_rank=1, tp_size=2, dp_rank=0, dp_size=2, pp_rank=0, pp_size=2),
    MeshCoord(rank=2, tp_rank=0, tp_size=2, dp_rank=1, dp_size=2, pp_rank=0, pp_size=2),
    MeshCoord(rank=3, tp_rank=1, tp_size=2, dp_rank=1, dp_size=2, pp_rank=0, pp_size=2),
    MeshCoord(rank=4, tp_rank=0, tp_size=2, dp_rank=0, dp_size=2, pp_rank=1, pp_size=2),
    MeshCoord(rank=5, tp_rank=1, tp_size=2, dp_rank=0, dp_size=2, pp_rank=1, pp_size=2),
    MeshCoord(rank=6, tp_rank=0, tp_size=2, dp_rank=1, dp_size=2, pp_rank=1, pp_size=2),
    MeshCoord(rank=7, tp_rank=1, tp_size=2, dp_rank=1, dp_size=2, pp_rank=1, pp_size=2),
]

# cp=2, dp=2 (cp faster than dp), with ep=2 riding on the same ranks.
CP2_DP2 = [
    MeshCoord(rank=0, cp_rank=0, cp_size=2, dp_rank=0, dp_size=2, ep_rank=0, ep_size=2),
    MeshCoord(rank=1, cp_rank=1, cp_size=2, dp_rank=0, dp_size=2, ep_rank=1, ep_size=2),
    MeshCoord(rank=2, cp_rank=0, cp_size=2, dp_rank=1, dp_size=2, ep_rank=0, ep_size=2),
    MeshCoord(rank=3, cp_rank=1, cp_size=2, dp_rank=1, dp_size=2, ep_rank=1, ep_size=2),
]


def make_batch(n: int) -> Batch:
    return Batch(
        tensors={"x": torch.arange(n, dtype=torch.float32), "tokens": torch.arange(3 * n).reshape(n, 3)},
        non_tensors={"uid": np.array([f"row{i}" for i in range(n)], dtype=object)},
    )


def test_one_to_all_sends_the_same_arguments_and_returns_every_output():
    coords = dp_mesh(3)
    marker = object()
    calls = split_args(Dispatch.ONE_TO_ALL, coords, (1, marker), {"flag": True})
    assert len(calls) == 3
    for args, kwargs in calls:
        assert args[0] == 1 and args[1] is marker and kwargs == {"flag": True}
    assert collect_outputs(Dispatch.ONE_TO_ALL, coords, ["a", "b", "c"]) == ["a", "b", "c"]


def test_all_to_all_gives_element_i_to_worker_i():
    coords = dp_mesh(3)
    calls = split_args(Dispatch.ALL_TO_ALL, coords, ([10, 11, 12],), {"name": ("p", "q", "r")})
    assert calls == [((10,), {"name": "p"}), ((11,), {"name": "q"}), ((12,), {"name": "r"})]
    assert collect_outputs(Dispatch.ALL_TO_ALL, coords, [0, 1, 2]) == [0, 1, 2]


def test_all_to_all_rejects_arguments_without_one_element_per_worker():
    coords = dp_mesh(3)
    expected = r"positional argument 0 must be a list with one element per worker \(3\), got a list of length 2"
    with pytest.raises(ValueError, match=expected):
        split_args(Dispatch.ALL_TO_ALL, coords, ([1, 2],), {})
    with pytest.raises(ValueError, match=r"argument 'lr'.*got float"):
        split_args(Dispatch.ALL_TO_ALL, coords, (), {"lr": 0.1})


def test_rank_zero_calls_every_worker_but_returns_rank_zero_only():
    coords = TP2_PP2_DP2
    calls = split_args(Dispatch.RANK_ZERO, coords, ("save",), {"step": 3})
    assert calls == [(("save",), {"step": 3})] * 8
    assert collect_outputs(Dispatch.RANK_ZERO, coords, [f"out{r}" for r in range(8)]) == "out0"


def test_dp_compute_splits_batches_by_dp_rank_and_broadcasts_other_arguments():
    coords = dp_mesh(4)
    batch = make_batch(8)
    calls = split_args(Dispatch.DP_COMPUTE, coords, (batch, 0.5), {"mask": batch, "mode": "train"})
    for worker, (args, kwargs) in enumerate(calls):
        assert args[0]["x"].tolist() == [2.0 * worker, 2.0 * worker + 1]
        assert list(args[0]["uid"]) == [f"row{2 * worker}", f"row{2 * worker + 1}"]
        assert kwargs["mask"]["tokens"].tolist() == batch["tokens"][2 * worker : 2 * worker + 2].tolist()
        assert args[1] == 0.5 and kwargs["mode"] == "train"


def test_dp_compute_on_tp2_pp2_dp2_gives_peers_of_a_dp_rank_the_same_chunk():
    batch = make_batch(6)
    calls = split_args(Dispatch.DP_COMPUTE, TP2_PP2_DP2, (batch,), {})
    chunk_by_rank = [args[0] for args, _ in calls]
    for rank in (0, 1, 4, 5):  # dp rank 0: both tp ranks of both pipeline stages
        assert chunk_by_rank[rank]["x"].tolist() == [0.0, 1.0, 2.0]
    for rank in (2, 3, 6, 7):
        assert chunk_by_rank[rank]["x"].tolist() == [3.0, 4.0, 5.0]
    # Peers share the chunk object, so the transport can serialize it once per dp rank.
    assert chunk_by_rank[0] is chunk_by_rank[5] and chunk_by_rank[2] is chunk_by_rank[7]


def test_dp_compute_on_tp2_pp2_dp2_gathers_from_tp0_of_the_last_stage_in_dp_order():
    assert dp_output_ranks(TP2_PP2_DP2) == [4, 6]
    batch = make_batch(6)
    calls = split_args(Dispatch.DP_COMPUTE, TP2_PP2_DP2, (batch,), {})
    outputs = []
    for rank, (args, _) in enumerate(calls):
        chunk = args[0]
        result = Batch(tensors={"y": chunk["x"] * 10, "computed_by": torch.full((len(chunk),), rank)})
        outputs.append(result)
    gathered = collect_outputs(Dispatch.DP_COMPUTE, TP2_PP2_DP2, outputs)
    assert isinstance(gathered, Batch)
    assert gathered["y"].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert gathered["computed_by"].tolist() == [4, 4, 4, 6, 6, 6]


def test_dp_compute_gathers_from_cp_rank_zero():
    assert dp_output_ranks(CP2_DP2) == [0, 2]
    outputs = [Batch(tensors={"r": torch.tensor([rank])}) for rank in range(4)]
    assert collect_outputs(Dispatch.DP_COMPUTE, CP2_DP2, outputs)["r"].tolist() == [0, 2]


def test_dp_compute_non_batch_outputs_come_back_as_a_list_in_dp_order():
    # Reverse the dp order against the global rank order to see that dp order wins.
    coords = [MeshCoord(rank=r, dp_rank=2 - r, dp_size=3) for r in range(3)]
    assert collect_outputs(Dispatch.DP_COMPUTE, coords, [{"loss": 0}, {"loss": 1}, {"loss": 2}]) == [
        {"loss": 2},
        {"loss": 1},
        {"loss": 0},
    ]
    assert collect_outputs(Dispatch.DP_COMPUTE, TP2_PP2_DP2, list(range(8))) == [4, 6]


def test_dp_compute_rejects_a_batch_not_divisible_by_dp_size():
    with pytest.raises(ValueError, match=r"argument 'batch' is a Batch of 5 rows, which is not divisible by dp_size=2"):
        split_args(Dispatch.DP_COMPUTE, TP2_PP2_DP2, (), {"batch": make_batch(5)})


def test_collect_rejects_a_wrong_number_of_outputs():
    with pytest.raises(ValueError, match="got 3 outputs for 8 workers"):
        collect_outputs(Dispatch.DP_COMPUTE, TP2_PP2_DP2, [1, 2, 3])


def test_validate_mesh_accepts_complete_meshes():
    for coords in (dp_mesh(1), dp_mesh(4), TP2_PP2_DP2, CP2_DP2):
        validate_mesh(coords)


def test_validate_mesh_rejects_a_missing_worker():
    expected = r"mesh is incomplete: dp_size\*tp_size\*pp_size\*cp_size = 2\*2\*2\*1 = 8, but the group has 7"
    with pytest.raises(MeshError, match=expected):
        validate_mesh(TP2_PP2_DP2[:7])


def test_validate_mesh_rejects_two_ranks_at_one_position():
    coords = list(TP2_PP2_DP2)
    coords[5] = MeshCoord(rank=5, tp_rank=0, tp_size=2, dp_rank=0, dp_size=2, pp_rank=1, pp_size=2)
    with pytest.raises(MeshError, match=r"ranks 4 and 5 claim the same mesh position \(dp=0, tp=0, pp=1, cp=0\)"):
        validate_mesh(coords)


def test_validate_mesh_rejects_disagreeing_sizes_and_out_of_range_ranks():
    coords = dp_mesh(2)
    with pytest.raises(MeshError, match="rank 1 reports tp_size=2 but rank 0 reports tp_size=1"):
        validate_mesh([coords[0], MeshCoord(rank=1, dp_rank=1, dp_size=2, tp_size=2)])
    with pytest.raises(MeshError, match=r"dp_rank=2 is outside \[0, dp_size=2\)"):
        validate_mesh([coords[0], MeshCoord(rank=1, dp_rank=2, dp_size=2)])
    with pytest.raises(MeshError, match="position 0 holds rank 1"):
        validate_mesh([coords[1], coords[0]])
    with pytest.raises(MeshError, match="at least one worker"):
        validate_mesh([])


def test_register_stores_the_dispatch_mode_on_the_method():
    class Example:
        @register(dispatch=Dispatch.DP_COMPUTE, blocking=False)
        def compute(self, batch):
            return batch

        def plain(self):
            return None

    assert registration_of(Example.compute) == Registration(dispatch=Dispatch.DP_COMPUTE, blocking=False)
    assert registration_of(Example().compute).dispatch is Dispatch.DP_COMPUTE  # bound method too
    assert registration_of(Example.plain) is None
    assert Example().compute(3) == 3  # the method itself is unchanged


def test_bare_register_is_rejected_with_a_hint():
    with pytest.raises(TypeError, match=r"write @register\(dispatch=Dispatch.X\)"):

        @register
        def compute(self, batch):
            return batch


def test_dispatch_module_does_not_import_ray():
    code = "import sys, megarl.controller.dispatch, megarl.controller.decorator; print('ray' in sys.modules)"
    repo_root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
