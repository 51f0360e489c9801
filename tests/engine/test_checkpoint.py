"""Distributed checkpoints of the Megatron engine: save in one layout, load in the same or another.

Three process groups are shared by every test here: a one-rank reference (two optimizer steps
from the Hugging Face weights, no checkpoint), a two-rank run that trains one step and saves a
TP=2 and an EP=2 checkpoint (then takes a second step without saving, through the same TP=2
engine), and a two-rank run that loads them: TP=2 into TP=2 (through MegatronActor), TP=2 into
TP=1 and into PP=2, EP=2 into EP=1, each followed by one more step.

Tolerances (fp32): log-probs after a load 1e-6 absolute against the one-rank reference after one
step (observed 4.8e-7, one float32 ulp at |log p| ~ 4); weights after the step that follows a load
1e-6 absolute against the reference's second step (observed 7e-9 across layouts) or, in the same
layout, against the uninterrupted run (observed 0); optimizer state after a same-layout load
bitwise equal to the state that was saved. Adam here has lr 1e-3 and eps 1e-2, as in
test_megatron_engine; a load that drops the moments moves the weights after the next step by
1.3e-3 (the weights-only control below), and a shared Adam step tensor (cpu_compat) by 4e-4, so
1e-6 detects a lost or wrong optimizer state.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from megarl.procs.net import free_port
from tests._dist import run_ranks
from tests.engine.test_megatron_engine import make_rows


def _spec(model_path, tp=1, ep=1, pp=1, distributed_optimizer=True):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec

    return EngineSpec(
        model_path=str(model_path),
        parallel=ParallelConfig(tp=tp, ep=ep, pp=pp, sequence_parallel=tp > 1),
        optim=OptimConfig(lr=1e-3, adam_eps=1e-2, clip_grad=0.0, use_distributed_optimizer=distributed_optimizer),
        micro_batch_size=2,
        seed=1,
    )


def _engine(model_path, **layout):
    from megatron.core import parallel_state as ps

    from megarl.engine.megatron.engine import MegatronEngine

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()  # one process builds several layouts in turn
    engine = MegatronEngine(_spec(model_path, **layout))
    engine.initialize()
    return engine


def _actor(model_path, rank, port, **layout):
    """A MegatronActor on its own process group (the one run_ranks made is given up)."""
    import torch.distributed as dist

    from megarl.engine.megatron.actor import ActorLossSpec, MegatronActor

    dist.destroy_process_group()
    actor = MegatronActor(
        _spec(model_path, **layout), ActorLossSpec(), rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port
    )
    actor.init_distributed()
    return actor


def _loss(logp, ent, mb):
    from megarl.algo.losses import policy_loss

    mask = mb["response_mask"]
    loss, _ = policy_loss(logp, logp.detach(), mb["advantages"], mask, global_denominator=1.0)
    return loss, mask.sum(), {}


def _step(engine):
    engine.train_mini_batch(make_rows(), _loss)


def _log_probs(engine):
    out = engine.compute_log_prob(make_rows())
    return None if out is None else out["log_probs"]


def _weights(engine):
    return {k: v.clone() for k, v in engine.export_weights()}


def _adam_state(engine):
    """(fp32 main shard, exp_avg, exp_avg_sq, step) of every parameter this rank optimizes."""
    found = []
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                s = opt.optimizer.state[p]
                found.append((p.detach().clone(), s["exp_avg"].clone(), s["exp_avg_sq"].clone(), float(s["step"])))
    return found


def _draw_rngs():
    """The next number of every RNG a checkpoint restores (this advances them)."""
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracked = torch.rand(4)
    return dict(python=random.random(), numpy=float(np.random.rand()), torch=torch.rand(4), tracker=tracked)


def _plain_optimizer_on_rank(rank, model_path, root):
    """actor.optim.use_distributed_optimizer=false (DP=2): save after a step, take a second step;
    a fresh engine loads the checkpoint and takes the same second step."""
    engine = _engine(model_path, distributed_optimizer=False)
    _step(engine)
    engine.save_checkpoint(os.path.join(root, "plain"))
    saved = _adam_state(engine)
    _step(engine)
    continued = _weights(engine)
    engine = _engine(model_path, distributed_optimizer=False)
    info = engine.load_checkpoint(os.path.join(root, "plain"))
    loaded = _adam_state(engine)
    _step(engine)
    return dict(info=info, saved=saved, loaded=loaded, continued=continued, resumed=_weights(engine))


def _reference_on_rank(rank, model_path):
    engine = _engine(model_path)
    _step(engine)
    log_probs = _log_probs(engine)
    _step(engine)
    return {"log_probs": log_probs, "weights": _weights(engine)}


def _save_on_rank(rank, model_path, root, port):
    actor = _actor(model_path, rank, port, tp=2)
    engine = actor.actor
    _step(engine)
    _draw_rngs()  # move every RNG off its seeded state, so restoring it is not vacuous
    meta = actor.save_checkpoint(os.path.join(root, "tp2"))
    saved = {"meta": meta, "adam": _adam_state(engine), "draws": _draw_rngs()}
    _step(engine)
    saved["continued"] = _weights(engine)

    ep2 = _engine(model_path, ep=2)
    _step(ep2)
    ep2.save_checkpoint(os.path.join(root, "ep2"))
    return saved


def _load_on_rank(rank, model_path, root, port):
    from megarl.engine.megatron.checkpoint import CheckpointError

    out = {}
    actor = _actor(model_path, rank, port, tp=2)
    engine = actor.actor
    fresh_draws = _draw_rngs()
    info = actor.load_checkpoint(os.path.join(root, "tp2"))
    out["tp2"] = dict(
        info=info, fresh_draws=fresh_draws, draws=_draw_rngs(), adam=_adam_state(engine), log_probs=_log_probs(engine)
    )
    _step(engine)
    out["tp2"]["weights"] = _weights(engine)

    control = _engine(model_path, tp=2)
    info = control.load_checkpoint(os.path.join(root, "tp2"), load_optimizer=False)
    _step(control)
    out["weights_only"] = dict(info=info, weights=_weights(control))

    for name, ckpt, layout in (("tp2_to_tp1", "tp2", {}), ("tp2_to_pp2", "tp2", {"pp": 2}), ("ep2_to_ep1", "ep2", {})):
        engine = _engine(model_path, **layout)
        info = engine.load_checkpoint(os.path.join(root, ckpt))
        out[name] = dict(info=info, log_probs=_log_probs(engine))
        _step(engine)
        out[name]["weights"] = _weights(engine)

    out["refused"] = {}
    for bad in ("no_marker", "interrupted", "interrupted.partial"):
        try:
            engine.load_checkpoint(os.path.join(root, bad))
        except CheckpointError as e:
            out["refused"][bad] = str(e)
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    reference = run_ranks(_reference_on_rank, 1, tiny_model_path)[0]
    saved = run_ranks(_save_on_rank, 2, tiny_model_path, str(root), free_port())
    listing = {name: sorted(os.listdir(root / name)) for name in os.listdir(root)}
    # what a crash leaves: shards without the marker (at the final name, or still `.partial`)
    shutil.copytree(root / "tp2", root / "no_marker")
    os.remove(root / "no_marker" / "megarl_ckpt.json")
    shutil.copytree(root / "no_marker", root / "interrupted.partial")
    loaded = run_ranks(_load_on_rank, 2, tiny_model_path, str(root), free_port())
    return dict(reference=reference, saved=saved, loaded=loaded, listing=listing, root=root)


def _assert_weights_close(got, want, atol, msg):
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, atol=atol, rtol=0, msg=f"{msg}: {name}")


def test_save_writes_complete_checkpoints_atomically(runs):
    listing = runs["listing"]
    assert set(listing) == {"tp2", "ep2"}  # no `.partial` directory left behind
    for name in ("tp2", "ep2"):
        assert {"megarl_ckpt.json", "metadata.json", ".metadata"} <= set(listing[name])
    meta = json.loads((runs["root"] / "tp2" / "megarl_ckpt.json").read_text())
    assert meta["complete"] is True and meta["optimizer"] == "fully_reshardable"
    assert meta["layout"] == dict(world_size=2, tp=2, pp=1, cp=1, ep=1, etp=1, dp=1, vpp=1)
    assert runs["saved"][0]["meta"] == meta  # what MegatronActor.save_checkpoint returned
    ep2 = json.loads((runs["root"] / "ep2" / "megarl_ckpt.json").read_text())
    assert (ep2["layout"]["ep"], ep2["layout"]["dp"]) == (2, 2)


def test_same_layout_restores_adam_state_and_rng(runs):
    for saved, loaded in zip(runs["saved"], runs["loaded"]):
        got = loaded["tp2"]
        assert got["info"]["optimizer"] and got["info"]["rng"]
        assert len(got["adam"]) == len(saved["adam"]) > 0
        for (p, m, v, step), (p0, m0, v0, step0) in zip(got["adam"], saved["adam"]):
            assert torch.equal(p, p0) and torch.equal(m, m0) and torch.equal(v, v0)
            assert step == step0 == 1.0
        assert any(m.abs().sum() > 0 for _, m, _, _ in saved["adam"])
        # RNG: after the load the next draws are those that followed the save; a fresh engine's are not
        for key in ("python", "numpy", "torch", "tracker"):
            assert _same(got["draws"][key], saved["draws"][key]), key
            assert not _same(got["fresh_draws"][key], saved["draws"][key]), key


def _same(a, b) -> bool:
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def test_same_layout_continuation_equals_uninterrupted_training(runs):
    for saved, loaded in zip(runs["saved"], runs["loaded"]):
        _assert_weights_close(loaded["tp2"]["weights"], saved["continued"], 1e-6, "tp2 -> tp2")
        torch.testing.assert_close(loaded["tp2"]["log_probs"], runs["reference"]["log_probs"], atol=1e-6, rtol=0)


def test_weights_only_load_changes_the_next_step(runs):
    """The control for the tolerance: without the Adam moments and step the next step differs."""
    got = runs["loaded"][0]["weights_only"]
    assert got["info"]["optimizer"] is False
    continued = runs["saved"][0]["continued"]
    assert max((got["weights"][k] - w).abs().max().item() for k, w in continued.items()) > 1e-4


@pytest.mark.parametrize("name", ["tp2_to_tp1", "tp2_to_pp2", "ep2_to_ep1"])
def test_other_layout_loads_weights_and_resharded_optimizer(runs, name):
    reference = runs["reference"]
    found = [r[name]["log_probs"] for r in runs["loaded"] if r[name]["log_probs"] is not None]
    assert found
    for log_probs in found:
        torch.testing.assert_close(log_probs, reference["log_probs"], atol=1e-6, rtol=0)
    for rank_result in runs["loaded"]:
        info = rank_result[name]["info"]
        assert info["optimizer"] and not info["rng"]  # RNG streams belong to the saved layout
        # the step after the load equals the reference's second step: moments and step resharded
        _assert_weights_close(rank_result[name]["weights"], reference["weights"], 1e-6, name)


def test_incomplete_checkpoints_are_refused(runs):
    for rank_result in runs["loaded"]:
        refused = rank_result["refused"]
        assert "megarl_ckpt.json is missing" in refused["no_marker"]
        assert "does not exist" in refused["interrupted"] and ".partial" in refused["interrupted"]
        assert "staging directory" in refused["interrupted.partial"]


def test_the_plain_optimizer_saves_and_resumes_its_adam_state(tiny_model_path, tmp_path):
    """The non-distributed optimizer's state (each rank holds all of it) goes through the same
    torch_dist checkpoint: moments and step come back bitwise, the next step equals the
    uninterrupted one."""
    for got in run_ranks(_plain_optimizer_on_rank, 2, tiny_model_path, str(tmp_path)):
        assert got["info"]["optimizer"]
        assert len(got["loaded"]) == len(got["saved"]) > 0
        for (p, m, v, step), (p0, m0, v0, step0) in zip(got["loaded"], got["saved"]):
            assert torch.equal(p, p0) and torch.equal(m, m0) and torch.equal(v, v0) and step == step0 == 1.0
        _assert_weights_close(got["resumed"], got["continued"], 0.0, "plain optimizer")


def test_read_metadata_rejects_a_marker_that_is_not_complete(tmp_path):
    from megarl.engine.megatron.checkpoint import MARKER, CheckpointError, read_metadata

    (tmp_path / MARKER).write_text(json.dumps({"complete": False, "version": 1}))
    with pytest.raises(CheckpointError, match="complete"):
        read_metadata(str(tmp_path))
