"""Virtual pipeline stages (interleaved 1F1B): PP=2 x VPP=2 against PP=1 on a 4-layer tiny Qwen3-MoE.

One 2-rank run does everything: the PP=2 x VPP=2 engine (rank 0 holds layers 0 and 2, rank 1
layers 1 and 3) exports its weights, lists its reshard pieces, computes log-probs (4 and 3 rows,
micro-batch size 1: 4 micro-batches, and 3 rounded to 2 because the interleaved schedule needs a
multiple of pp) and takes one optimizer step; then the same processes rebuild Megatron's parallel
state as PP=1 (data parallel 2, both ranks given the same rows, which equals one rank) and repeat.

Tolerances: fp32; log-probs 1e-5 absolute (also against the Hugging Face model in float64);
weights after one Adam step (lr 1e-3, eps 1e-2) 1e-6 absolute; grad norm 1e-5 relative. Weights
exported before training equal the HF checkpoint exactly (they are copies of it).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests._dist import run_ranks
from tests.engine.test_megatron_engine import hf_reference, make_rows


@pytest.fixture(scope="module")
def four_layer_path(tmp_path_factory):
    from megarl.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny4") / "tiny-qwen3-moe-4l", seed=0, num_hidden_layers=4)


def _engine(model_path, pp, vpp, micro_batch_size):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    engine = MegatronEngine(
        EngineSpec(
            model_path=str(model_path),
            parallel=ParallelConfig(pp=pp, vpp=vpp, sequence_parallel=False),
            optim=OptimConfig(lr=1e-3, adam_eps=1e-2, clip_grad=0.0),
            micro_batch_size=micro_batch_size,
            seed=1,
        )
    )
    engine.initialize()
    return engine


def _loss_fn(logp, ent, mb):
    from megarl.algo.losses import policy_loss

    mask = mb["response_mask"]
    loss, metrics = policy_loss(logp, logp.detach(), mb["advantages"], mask, global_denominator=1.0)
    return loss, mask.sum(), {"pg_loss": metrics["pg_loss"]}


def _layers_per_chunk(engine) -> list[list[int]]:
    from megarl.engine.megatron.weights import local_to_global_names

    return [
        sorted(
            {
                int(m.group(1))
                for g in local_to_global_names(c).values()
                if (m := re.search(r"decoder\.layers\.(\d+)\.", g))
            }
        )
        for c in engine.bare_chunks()
    ]


def _exercise(engine) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rows = make_rows()
    before = {k: v.clone() for k, v in engine.export_weights()}
    pieces = [(p.name, p.shape, p.box, p.fetch().clone()) for p in engine.local_pieces()]
    owned = {k: v.clone() for k, v in engine.export_owned_weights()}
    four = engine.compute_log_prob(rows)
    three = engine.compute_log_prob(rows[:3])
    metrics = engine.train_mini_batch(rows, _loss_fn)
    after = {k: v.clone() for k, v in engine.export_weights()}
    return dict(
        schedule=get_forward_backward_func().__name__,
        layers=_layers_per_chunk(engine),
        before=before,
        pieces=pieces,
        owned=owned,
        sends=engine.sends_owned_weights(),
        grad_norm=metrics["actor/grad_norm"],
        after=after,
        log_probs=None if four is None else four["log_probs"],
        log_probs3=None if three is None else three["log_probs"],
    )


def _vpp_then_pp1_on_rank(rank, model_path):
    import gc

    from megatron.core import parallel_state as ps

    vpp = _exercise(_engine(model_path, pp=2, vpp=2, micro_batch_size=1))
    gc.collect()
    ps.destroy_model_parallel()
    pp1 = _exercise(_engine(model_path, pp=1, vpp=1, micro_batch_size=2))
    return {"vpp": vpp, "pp1": pp1}


@pytest.fixture(scope="module")
def results(four_layer_path):
    return run_ranks(_vpp_then_pp1_on_rank, 2, four_layer_path)


def _checkpoint(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _last_stage(results, key, which="vpp"):
    found = [r[which][key] for r in results if r[which][key] is not None]
    assert len(found) == 1, f"{which}: {len(found)} ranks returned {key}"
    return found[0]


def test_each_rank_holds_two_interleaved_chunks(results):
    assert {r["vpp"]["schedule"] for r in results} == {"forward_backward_pipelining_with_interleaving"}
    assert {r["pp1"]["schedule"] for r in results} == {"forward_backward_no_pipelining"}
    assert [r["vpp"]["layers"] for r in results] == [[[0], [2]], [[1], [3]]]
    assert [r["pp1"]["layers"] for r in results] == [[[0, 1, 2, 3]]] * 2


def test_vpp_log_probs_equal_pp1_and_hugging_face(results, four_layer_path):
    ref = results[0]["pp1"]["log_probs"]
    assert torch.equal(ref, results[1]["pp1"]["log_probs"])
    torch.testing.assert_close(_last_stage(results, "log_probs"), ref, atol=1e-5, rtol=0)
    mask = make_rows()["response_mask"]
    hf = hf_reference(four_layer_path)
    torch.testing.assert_close(ref.double() * mask, hf * mask, atol=1e-5, rtol=0)
    assert hf.abs().sum() > 0


def test_vpp_with_rows_not_a_multiple_of_pp(results):
    """3 rows at micro-batch size 1: 3 micro-batches would break the schedule, 2 are run."""
    got = _last_stage(results, "log_probs3")
    assert got.shape[0] == 3
    torch.testing.assert_close(got, results[0]["pp1"]["log_probs"][:3], atol=1e-5, rtol=0)


def test_vpp_export_equals_hf_checkpoint(results, four_layer_path):
    ckpt = _checkpoint(four_layer_path)
    assert any(".layers.3." in k for k in ckpt)
    for r in results:
        exported = r["vpp"]["before"]
        assert set(exported) == set(ckpt)
        for name, tensor in ckpt.items():
            assert torch.equal(exported[name], tensor), name


def test_vpp_owned_weights_and_reshard_pieces_cover_the_checkpoint(results, four_layer_path):
    """Distributed transport: each stage sends its own chunks' weights; reshard: the pieces the
    ranks list (from both chunks) tile every HF tensor with the checkpoint's values."""
    ckpt = _checkpoint(four_layer_path)
    assert all(r["vpp"]["sends"] for r in results)
    owned = [r["vpp"]["owned"] for r in results]
    assert not set(owned[0]) & set(owned[1])
    merged = {**owned[0], **owned[1]}
    assert set(merged) == set(ckpt)
    for name, tensor in ckpt.items():
        assert torch.equal(merged[name], tensor), name
    covered = {name: torch.zeros(t.shape, dtype=torch.int) for name, t in ckpt.items()}
    for r in results:
        for name, shape, box, values in r["vpp"]["pieces"]:
            assert tuple(shape) == tuple(ckpt[name].shape), name
            index = tuple(slice(a, b) for a, b in box)
            assert torch.equal(values, ckpt[name][index]), name
            covered[name][index] += 1
    for name, count in covered.items():
        assert bool((count == 1).all()), f"{name}: covered {count.min()}..{count.max()} times"


def test_vpp_train_step_equals_pp1(results, four_layer_path):
    ref = results[0]["pp1"]
    assert ref["grad_norm"] > 0
    for r in results:
        got = r["vpp"]
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert set(got["after"]) == set(ref["after"])
        for name, w in ref["after"].items():
            torch.testing.assert_close(got["after"][name], w, atol=1e-6, rtol=0, msg=name)
    ckpt = _checkpoint(four_layer_path)
    changed = sum(int(not torch.equal(ckpt[k], ref["after"][k])) for k in ckpt)
    assert changed > len(ckpt) // 2


def test_interleaved_micro_batch_count():
    from megarl.config.schema import ParallelConfig
    from megarl.engine.megatron.inputs import interleaved_micro_batch_count

    def count(n, rows, p=ParallelConfig(pp=2, vpp=2)):
        return interleaved_micro_batch_count(n, rows, p)

    assert [count(n, rows) for n, rows in ((1, 4), (2, 4), (3, 8), (3, 3), (5, 5), (4, 4))] == [2, 2, 4, 2, 4, 4]
    with pytest.raises(ValueError, match=r"actor\.parallel\.vpp=2.*at least pp=2"):
        count(1, 1)
    assert count(3, 3, ParallelConfig(pp=2)) == 3


def test_vpp_validation_names_the_option():
    from megarl.config.loader import ConfigError
    from megarl.config.schema import RunConfig
    from megarl.config.validate import validate
    from megarl.models.tiny import TINY_QWEN3_MOE

    def check(model=TINY_QWEN3_MOE, **parallel):
        cfg = RunConfig()
        for k, v in parallel.items():
            setattr(cfg.actor.parallel, k, v)
        return validate(cfg, model)

    with pytest.raises(ConfigError, match=r"actor\.parallel\.vpp=2 needs actor\.parallel\.pp > 1"):
        check(vpp=2)
    with pytest.raises(ConfigError, match=r"pp\*vpp=2\*2=4 does not divide model\.num_hidden_layers=2"):
        check(pp=2, vpp=2, ep=1)
    with pytest.raises(ConfigError, match=r"actor\.parallel\.vpp=0 must be > 0"):
        check(vpp=0)
    assert check({**TINY_QWEN3_MOE, "num_hidden_layers": 4}, pp=2, vpp=2, ep=1).actor.parallel.vpp == 2
    cfg = RunConfig()
    cfg.model.path, cfg.model.num_hidden_layers = "/some/checkpoint", 4
    with pytest.raises(ConfigError, match=r"model\.num_hidden_layers=4 overrides a preset's depth"):
        validate(cfg)
