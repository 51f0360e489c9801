"""actor.offload.host_optimizer: Megatron's hybrid (host) Adam against its device Adam, on CPU.

Two gloo ranks (ep=2, data parallel 2: a dense and an expert distributed optimizer, the dense
state sharded over both ranks), bf16 parameters, AdamW with weight decay. On CPU "host" and
"device" are one memory, but the path is the GPU's: the host share's fp32 master weights and
moments live in separate copies, gradients are copied in, updated weights copied back
(engine/megatron/cpu/host_adam.py says what is adapted).

Reference: the same run with host_optimizer=0, Megatron's distributed optimizer over torch's
AdamW, none of the hybrid code. Tolerances after two steps (lr 1e-3, eps 1e-2, weight decay 0.1):
fp32 master weights 1e-7 absolute (observed 4e-9: the host Adam is torch's fused CPU kernel,
the device one its for-each kernel; one step's update is ~1e-3 and its weight decay ~2e-6, so a
lost or doubled step or decay fails), moments 1e-5 relative, bf16 weights within one bf16 ulp
(observed equal). The 0.5 run also offloads and onloads its optimizer between the steps
(actor.offload.optimizer: colocation). Resume: a checkpoint saved after step one and loaded into a fresh engine gives
the uninterrupted run's second step exactly (same kernels, same order).
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch

from tests._dist import run_ranks
from tests.engine.test_megatron_engine import make_rows
from tests.engine.test_offload import _loss_fn

SHARES = (0.0, 1.0, 0.5)


def _engine(model_path, share: float):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    spec = EngineSpec(
        model_path=str(model_path),
        parallel=ParallelConfig(ep=2),
        optim=OptimConfig(lr=1e-3, adam_eps=1e-2, weight_decay=0.1),
        micro_batch_size=2,
        seed=1,
        precision="bf16",
        host_optimizer=share,
    )
    engine = MegatronEngine(spec)
    engine.initialize()
    return engine


def _state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Per model parameter: its bf16 weight and this rank's fp32 master shard, exp_avg, exp_avg_sq."""
    out = {}
    for opt in engine.optimizer.chained_optimizers:
        for name, param in engine.bare_chunks()[0].named_parameters():
            if param in opt.model_param_group_index_map:
                found = opt._get_main_param_and_optimizer_states(param)
                out[name] = {k: found[k].detach().clone() for k in ("param", "exp_avg", "exp_avg_sq")}
                out[name]["weight"] = param.detach().clone()
    return out


def _host_layout(engine) -> dict:
    """Elements the hybrid optimizers step on separate (host) copies, and all they step."""
    host = total = shared = 0
    for opt in engine.optimizer.chained_optimizers:
        inner = opt.optimizer
        if not hasattr(inner, "cpu_optimizers"):
            continue
        model = {p.untyped_storage().data_ptr() for p in engine.bare_chunks()[0].parameters()}
        for sub in inner.cpu_optimizers:
            for p in (p for g in sub.param_groups for p in g["params"]):
                host += p.numel()
                shared += p.untyped_storage().data_ptr() in model
        total += sum(p.numel() for g in inner.param_groups for p in g["params"])
    return dict(host=host, total=total, shared_with_model=shared)


def _on_rank(rank, model_path, ckpt):
    rows = make_rows()
    out = {}
    for share in SHARES:
        engine = _engine(model_path, share)
        initial = _state_weights(engine)
        engine.train_mini_batch(rows, _loss_fn)
        moved = None
        if share == 1.0:
            engine.save_checkpoint(ckpt)
        if share == 0.5:  # colocation offload between the steps moves the hybrid's state too
            moved = engine.offload(params=False, grads=False, optimizer=True)
            engine.onload()
        engine.train_mini_batch(rows, _loss_fn)
        out[share] = dict(state=_state(engine), initial=initial, layout=_host_layout(engine), moved=moved)
    resumed = _engine(model_path, 1.0)
    resumed.load_checkpoint(ckpt)
    resumed.train_mini_batch(rows, _loss_fn)
    out["resumed"] = _state(resumed)
    return out


def _state_weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.bare_chunks()[0].named_parameters()}


@pytest.fixture(scope="module")
def results(tiny_model_path):
    ckpt = tempfile.mkdtemp(prefix="megarl_hostopt_")
    try:
        yield run_ranks(_on_rank, 2, tiny_model_path, f"{ckpt}/step1")
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


def test_the_hybrid_optimizer_steps_the_configured_share_on_separate_copies(results):
    for r in results:
        assert r[0.0]["layout"] == dict(host=0, total=0, shared_with_model=0)  # no hybrid optimizer
        full, half = r[1.0]["layout"], r[0.5]["layout"]
        assert full["total"] > 0 and full["host"] == full["total"]
        # Megatron walks the parameters until the copied elements reach the share
        assert 0.5 * half["total"] <= half["host"] < half["total"]
        # the host Adam updates its own fp32 copies, never the model's storage
        assert full["shared_with_model"] == 0 and half["shared_with_model"] == 0


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_host_adam_updates_equal_device_adam_after_two_steps(results, share):
    for r in results:
        ref, got = r[0.0]["state"], r[share]["state"]
        assert got.keys() == ref.keys() and ref
        for name in ref:
            a, b = got[name], ref[name]
            assert a["weight"].dtype == torch.bfloat16 and a["param"].dtype == torch.float32
            assert torch.allclose(a["param"], b["param"], rtol=0, atol=1e-7), name
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-12), (name, k)
            ulp = b["weight"].float().abs() * 2**-7
            assert ((a["weight"].float() - b["weight"].float()).abs() <= ulp).all(), name
        # not vacuous: the two steps moved most weights
        moved = sum(not torch.equal(r[share]["initial"][n], got[n]["weight"]) for n in got)
        assert moved > len(got) // 2


def test_colocation_offload_of_the_optimizer_moves_the_hybrid_state(results):
    # the step after the round trip equals device Adam's (the test above); here: it moved the
    # master weights and moments of every parameter (on CPU all of them count as the device's)
    for r in results:
        elements = sum(v["param"].numel() for v in r[0.5]["state"].values())
        assert r[0.5]["moved"] >= 3 * 4 * elements


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(results):
    for r in results:
        ref, got = r[1.0]["state"], r["resumed"]
        assert got.keys() == ref.keys()
        for name in ref:
            for k in ("weight", "param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got[name][k], ref[name][k]), (name, k)
