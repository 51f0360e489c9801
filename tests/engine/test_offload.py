"""Offload for colocation: parameters, gradients and optimizer state leave the device and return.

On CPU the device is the host, so what is checked is what matters on a GPU too: every storage is
released (size 0) while offloaded, everything returns bit for bit (torch.equal, no tolerance), and
training after an offload/onload round trip is bitwise identical to training without one.
"""

from __future__ import annotations

import pytest
import torch

from megarl.procs.net import free_port
from tests._dist import run_ranks
from tests.engine.test_megatron_engine import make_rows


def _spec(model_path, distributed_optimizer=True, train=True):
    from megarl.config.schema import OptimConfig
    from megarl.engine.megatron.engine import EngineSpec

    optim = OptimConfig(lr=1e-3, adam_eps=1e-2, use_distributed_optimizer=distributed_optimizer)
    return EngineSpec(model_path=str(model_path), micro_batch_size=2, seed=1, optim=optim if train else None)


def _loss_fn(logp, ent, mb):
    from megarl.algo.losses import policy_loss

    mask = mb["response_mask"]
    loss, _ = policy_loss(logp, logp.detach() - 0.1, mb["advantages"], mask, global_denominator=1.0)
    return loss, mask.sum(), {}


def _adam_moments(optimizer):
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [
        v
        for o in inner
        for state in o.optimizer.state.values()
        for k, v in state.items()
        if k in ("exp_avg", "exp_avg_sq")
    ]


def _snapshot(engine):
    params = [p.detach().clone() for p in engine.model[0].parameters()]
    grads = [p.main_grad.clone() for p in engine.model[0].parameters() if hasattr(p, "main_grad")]
    moments = [m.clone() for m in _adam_moments(engine.optimizer)] if engine.optimizer else []
    return params, grads, moments


def _round_trip(engine) -> dict:
    """Offload everything, record what was released, bring it back, compare with a snapshot."""
    before = _snapshot(engine)
    moved = engine.offload()
    params = list(engine.model[0].parameters())
    grads = [p.main_grad for p in params if hasattr(p, "main_grad")]
    moments = _adam_moments(engine.optimizer) if engine.optimizer else []
    released = {
        "params": [p.untyped_storage().size() for p in params],
        "grads": [g.untyped_storage().size() for g in grads],
        "moments": [m.untyped_storage().size() for m in moments],
    }
    parts = engine.offloaded()
    engine.onload()
    after = _snapshot(engine)
    equal = all(torch.equal(a, b) for x, y in zip(before, after) for a, b in zip(x, y))
    counts = [len(x) for x in before]
    return {
        "released": released,
        "moved": moved,
        "parts": parts,
        "equal": equal,
        "counts": counts,
        "after_onload": engine.offloaded(),
    }


def _engines_on_rank(rank, model_path):
    import time

    from megarl.engine.megatron.engine import MegatronEngine

    rows = make_rows()
    out = {}
    # the actor: one step, offload/onload, a second step -- against two steps without offload
    for name, dist_opt in (("distopt", True), ("plain", False)):
        engine = MegatronEngine(_spec(model_path, dist_opt))
        engine.initialize()
        engine.train_mini_batch(rows, _loss_fn)
        out[name] = _round_trip(engine)
        engine.train_mini_batch(rows, _loss_fn)
        out[name]["weights"] = [p.detach().clone() for p in engine.model[0].parameters()]
        out[name]["log_probs"] = engine.compute_log_prob(rows)["log_probs"]
        if name == "distopt":
            start = time.perf_counter()
            for _ in range(5):
                engine.offload()
                engine.onload()
            out["round_trip_s"] = (time.perf_counter() - start) / 5
        baseline = MegatronEngine(_spec(model_path, dist_opt))
        baseline.initialize()
        out[name]["initial_weights"] = [p.detach().clone() for p in baseline.model[0].parameters()]
        for _ in range(2):
            baseline.train_mini_batch(rows, _loss_fn)
        out[name]["baseline_weights"] = [p.detach().clone() for p in baseline.model[0].parameters()]
    # the reference: forward-only, its weights leave the device between calls
    ref = MegatronEngine(_spec(model_path, train=False))
    ref.initialize()
    first = ref.compute_log_prob(rows)["log_probs"]
    out["ref"] = _round_trip(ref)
    out["ref_log_probs"] = (first, ref.compute_log_prob(rows)["log_probs"])
    return out


@pytest.fixture(scope="module")
def engine_results(tiny_model_path):
    return run_ranks(_engines_on_rank, 1, tiny_model_path)[0]


@pytest.mark.parametrize("name", ["distopt", "plain"])
def test_actor_offload_releases_every_storage_and_restores_bitwise(engine_results, name):
    r = engine_results[name]
    assert r["parts"] == {"params", "grads", "optimizer"}
    n_params, n_grads, n_moments = r["counts"]
    assert n_params > 0 and n_grads == n_params and n_moments > 0
    for part in ("params", "grads", "moments"):
        assert r["released"][part] and all(size == 0 for size in r["released"][part]), part
    param_bytes = sum(w.numel() * w.element_size() for w in r["weights"])
    assert r["moved"] >= 2 * param_bytes  # at least the weights and their fp32 gradients
    assert r["equal"]
    assert r["after_onload"] == set()


def test_training_after_offload_equals_training_without(engine_results):
    """One step after an offload/onload round trip equals the same step without (bitwise)."""
    for name in ("distopt", "plain"):
        r = engine_results[name]
        assert len(r["weights"]) == len(r["baseline_weights"])
        assert all(torch.equal(a, b) for a, b in zip(r["weights"], r["baseline_weights"])), name
        # not vacuous: the steps changed most weights
        changed = sum(not torch.equal(a, b) for a, b in zip(r["initial_weights"], r["weights"]))
        assert changed > len(r["weights"]) // 2, name


def test_reference_weights_leave_and_return(engine_results):
    r = engine_results["ref"]
    assert r["parts"] == {"params"}  # a forward-only engine has no gradients or optimizer
    assert all(size == 0 for size in r["released"]["params"])
    assert r["equal"]
    first, again = engine_results["ref_log_probs"]
    assert torch.equal(first, again)


def test_offload_round_trip_time_is_reported(engine_results):
    print(f"\noffload+onload of the tiny actor (params, grads, Adam): {engine_results['round_trip_s'] * 1e3:.2f} ms")
    assert 0 < engine_results["round_trip_s"] < 5


def _actor_worker_on_rank(rank, model_path, port):
    """A MegatronActor with every part offloaded and an offloaded reference, through one step."""
    import torch.distributed as dist

    from megarl.config.schema import OffloadConfig
    from megarl.engine.megatron.actor import ActorLossSpec, MegatronActor

    dist.destroy_process_group()  # the worker joins its own group, as under Ray
    actor = MegatronActor(
        _spec(model_path),
        ActorLossSpec(),
        with_ref=True,
        offload=OffloadConfig(params=True, grads=True, optimizer=True),
        ref_offload=True,
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=port,
    )
    actor.init_distributed()
    states = {}

    def record(when):
        states[when] = (actor.actor.offloaded(), actor.ref.offloaded())

    record("init")
    rows = make_rows()
    old = actor.compute_log_prob(rows)
    record("log_prob")
    ref = actor.compute_ref_log_prob(rows)
    record("ref")
    metrics = actor.update_actor(rows.union(old.select("old_log_probs")), mini_batch_size=4)
    record("update")
    with actor.actor_offload.forward():  # what sync_weights runs in (no rollout server here)
        pass
    record("sync")
    return {"states": states, "old": old["old_log_probs"], "ref": ref["ref_log_probs"], "metrics": metrics}


def test_actor_worker_offloads_between_steps_and_the_reference_between_calls(engine_results, tiny_model_path):
    r = run_ranks(_actor_worker_on_rank, 1, tiny_model_path, free_port())[0]
    everything = {"params", "grads", "optimizer"}
    s = r["states"]
    assert s["init"] == ({"params", "grads"}, {"params"})  # no Adam moments before a step
    assert s["log_prob"] == ({"grads"}, {"params"})  # parameters back for the forward
    assert s["ref"] == ({"grads"}, {"params"})  # the reference left again
    assert s["update"] == ({"grads", "optimizer"}, {"params"})  # parameters stay for the sync
    assert s["sync"] == (everything, {"params"})
    # both engines computed on weights that went to the host and back: equal to a fresh engine
    first = engine_results["ref_log_probs"][0]
    assert torch.equal(r["old"], first) and torch.equal(r["ref"], first)
    m = r["metrics"]
    assert m["actor/grad_norm"] > 0
    assert m["perf/actor_offload_s"] > 0 and m["perf/actor_onload_s"] > 0
    assert m["perf/ref_offload_s"] > 0 and m["perf/ref_onload_s"] > 0
    print(
        "\nmoving time in one step: "
        + ", ".join(f"{k}={v * 1e3:.2f} ms" for k, v in sorted(m.items()) if k.endswith("load_s"))
    )
