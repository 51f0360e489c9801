"""The recipes on the Megatron workers: SPIN's coupled loss through the actor's update, the
reference refreshed from the actor (and checkpointed), PRIME's implicit PRM learning and resuming.

SPIN: 4 prompts x (1 chosen + 2 samples), micro-batches of 2 rows (so a group's rows are split),
2 mini-batches of whole groups, 2 epochs (the first mini-batch weighted from the old log-probs,
every later one from a forward pass). Under DP=2, PP=2, CP=2, TP=2 (sequence parallel) and EP=2
(the experts split, the dense layers data-parallel) the weights after every step equal a
single-rank reference that computes the whole pairwise loss in one micro-batch (fp32; 1e-6
absolute, observed ~1e-8) and the grad norms agree to 1e-5; with stale row weights (a bug) they
would differ by the step itself.
"""

from __future__ import annotations

import pytest
import torch

from megarl.procs.net import free_port
from tests._dist import run_ranks

GROUPS = [  # (prompt, chosen, samples)
    ([2, 10, 11, 3], [12, 1], [[13, 14, 1], [15]]),
    ([2, 20, 3], [21, 22, 23, 1], [[24, 1], [25, 26, 27]]),
    ([2, 30, 31, 32, 3], [33, 1], [[34, 35], [36, 1]]),
    ([2, 40, 3], [41, 1], [[42, 43, 44, 45, 1], [46]]),
]
SEED, BETA, LR = 7, 0.5, 1e-2


def spin_rows():
    """Group-contiguous rows: each prompt's chosen row, then its samples."""
    from megarl.data.batch import Batch

    rows = [(p, r, float(k == 0), g) for g, (p, c, s) in enumerate(GROUPS) for k, r in enumerate([c, *s])]
    T, R = max(len(p) + len(r) for p, r, _, _ in rows), max(len(r) for _, r, _, _ in rows)
    ids, resp, mask = (
        torch.zeros(len(rows), T, dtype=torch.long),
        torch.zeros(len(rows), R, dtype=torch.long),
        torch.zeros(len(rows), R),
    )
    for i, (p, r, _, _) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        resp[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return Batch(
        {
            "input_ids": ids,
            "responses": resp,
            "response_mask": mask,
            "prompt_lengths": torch.tensor([len(p) for p, _, _, _ in rows]),
            "chosen": torch.tensor([c for _, _, c, _ in rows]),
            "group_index": torch.tensor([g for _, _, _, g in rows]),
        }
    )


def _spec(model_path, micro=2, distributed_optimizer=False, **layout):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec

    return EngineSpec(
        model_path=str(model_path),
        parallel=ParallelConfig(**layout),
        optim=OptimConfig(lr=LR, adam_eps=1e-2, clip_grad=0.0, use_distributed_optimizer=distributed_optimizer),
        micro_batch_size=micro,
        seed=1,
    )


def _worker(cls, rank, world, *args, **kwargs):
    """A worker on its own process group (the one run_ranks made is given up), as under Ray."""
    import torch.distributed as dist

    dist.destroy_process_group()
    w = cls(*args, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=kwargs.pop("port"), **kwargs)
    w.init_distributed()
    return w


def _global_minis(batch, dp: int, n_mini: int, epochs: int):
    """The mini-batches update_actor trains, as whole batches: each dp rank's k-th (group_mini_batches
    of its contiguous share, its generator seeded alike), joined."""
    from megarl.data.batch import Batch
    from megarl.engine.megatron.sequence_update import group_mini_batches

    gens = [torch.Generator().manual_seed(SEED) for _ in range(dp)]
    out = []
    for _ in range(epochs):
        per_rank = [group_mini_batches(part, n_mini, g) for part, g in zip(batch.chunk(dp), gens)]
        out += [Batch.concat(list(parts)) for parts in zip(*per_rank)]
    return out


def _reference_on_rank(rank, model_path, port):
    """One rank: ref log-probs, then for dp in (1, 2) the steps with the whole loss in one micro-batch."""
    from megarl.algo.sequence_losses import SequenceLossConfig, get_sequence_loss, sequence_log_ratio
    from megarl.engine.megatron.engine import MegatronEngine

    torch.distributed.destroy_process_group()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    loss, cfg = get_sequence_loss("spin"), SequenceLossConfig(spin_beta=BETA)
    out = {}
    for dp in (1, 2):
        engine = MegatronEngine(_spec(model_path, micro=64))
        engine.initialize()
        batch = spin_rows()
        batch["ref_log_probs"] = engine.compute_log_prob(batch, with_entropy=False)["log_probs"]
        out["ref_log_probs"] = batch["ref_log_probs"]

        def whole(lp, ent, mb):
            value, units, _ = loss.fn(
                sequence_log_ratio(lp, mb["ref_log_probs"], mb["response_mask"]),
                cfg=cfg,
                group_index=mb["group_index"],
                chosen=mb["chosen"],
            )
            return value.float(), units, {}

        norms = [engine.train_mini_batch(mini, whole)["actor/grad_norm"] for mini in _global_minis(batch, dp, 2, 2)]
        out[f"dp{dp}"] = {"norms": norms, "weights": {k: v.clone() for k, v in engine.export_weights()}}
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    return out


def _spin_on_rank(rank, model_path, port, ref_log_probs, layout):
    from megarl.algo.sequence_losses import SequenceLossConfig
    from megarl.engine.megatron.actor import ActorLossSpec, MegatronActor

    spec = ActorLossSpec(policy_loss="spin", sequence=SequenceLossConfig(spin_beta=BETA))
    actor = _worker(MegatronActor, rank, 2, _spec(model_path, **layout), spec, port=port)
    batch = spin_rows()
    batch["ref_log_probs"] = ref_log_probs
    batch["old_log_probs"] = ref_log_probs  # the initial weights' own: the first mini-batch's weights
    coord = actor.get_mesh_coord()
    # 6 rows a mini-batch: 2 of whole groups per rank and epoch
    metrics = actor.update_actor(batch.chunk(coord.dp_size)[coord.dp_rank], len(batch) // 2, epochs=2, seed=SEED)
    return {"metrics": metrics, "weights": {k: v.clone() for k, v in actor.actor.export_weights()}}


def _refresh_on_rank(rank, model_path, port, ckpt):
    """The reference takes the actor's weights on refresh_ref; a checkpoint keeps the refreshed one."""
    from megarl.engine.megatron.actor import ActorLossSpec, MegatronActor

    spec = _spec(model_path, distributed_optimizer=True)  # what runs use (and what checkpoints load)
    actor = _worker(MegatronActor, rank, 1, spec, ActorLossSpec(), True, port=port)
    rows = spin_rows()
    rows["advantages"] = torch.linspace(-1, 1, len(rows)).unsqueeze(1) * rows["response_mask"]
    lp = lambda: actor.compute_log_prob(rows)["old_log_probs"]  # noqa: E731
    ref = lambda: actor.compute_ref_log_prob(rows)["ref_log_probs"]  # noqa: E731

    def step():
        rows["old_log_probs"] = lp()
        actor.update_actor(rows, len(rows), seed=0)

    step()
    out = {"before": (lp(), ref())}
    out["refresh"] = actor.refresh_ref()
    out["after"] = (lp(), ref())
    actor.save_checkpoint(f"{ckpt}/actor", ref_path=f"{ckpt}/ref")
    step()
    actor.refresh_ref()
    out["moved_on"] = ref()
    actor.load_checkpoint(f"{ckpt}/actor", ref_path=f"{ckpt}/ref")
    out["restored"] = (lp(), ref())
    return out


def _prm_on_rank(rank, model_path, port, ckpt):
    """The PRM learns fixed outcome labels, and its checkpoint resumes it."""
    from megarl.algo.sequence_losses import SequenceLossConfig
    from megarl.engine.megatron.prm import MegatronPRM

    spec = _spec(model_path, distributed_optimizer=True)
    prm = _worker(MegatronPRM, rank, 1, spec, SequenceLossConfig(prm_beta=0.5), port=port)
    rows = spin_rows()
    rows["ref_log_probs"] = prm.compute_prm_log_prob(rows)["prm_log_probs"]  # the PRM starts as the reference
    rows["prm_labels"] = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0])
    metrics = [prm.update_prm(rows, len(rows), seed=k) for k in range(6)]
    saved = prm.compute_prm_log_prob(rows)["prm_log_probs"]
    prm.save_checkpoint(ckpt)
    metrics.append(prm.update_prm(rows, len(rows), seed=6))
    moved = prm.compute_prm_log_prob(rows)["prm_log_probs"]
    prm.load_checkpoint(ckpt)
    return {
        "ref": rows["ref_log_probs"],
        "metrics": metrics,
        "saved": saved,
        "moved": moved,
        "restored": prm.compute_prm_log_prob(rows)["prm_log_probs"],
        "after_resume": prm.update_prm(rows, len(rows), seed=6),
    }


@pytest.fixture(scope="module")
def spin_runs(tiny_model_path):
    ref = run_ranks(_reference_on_rank, 1, tiny_model_path, free_port())[0]
    return {
        "reference": ref,
        "dp2": run_ranks(_spin_on_rank, 2, tiny_model_path, free_port(), ref["ref_log_probs"], {}),
        "pp2": run_ranks(_spin_on_rank, 2, tiny_model_path, free_port(), ref["ref_log_probs"], {"pp": 2}),
        "cp2": run_ranks(_spin_on_rank, 2, tiny_model_path, free_port(), ref["ref_log_probs"], {"cp": 2}),
        "tp2": run_ranks(
            _spin_on_rank, 2, tiny_model_path, free_port(), ref["ref_log_probs"], {"tp": 2, "sequence_parallel": True}
        ),
        "ep2": run_ranks(_spin_on_rank, 2, tiny_model_path, free_port(), ref["ref_log_probs"], {"ep": 2}),
    }


@pytest.mark.parametrize("layout, dp", [("dp2", 2), ("pp2", 1), ("cp2", 1), ("tp2", 1), ("ep2", 2)])
def test_spin_update_equals_the_whole_pairwise_loss(spin_runs, layout, dp):
    want = spin_runs["reference"][f"dp{dp}"]
    runs = spin_runs[layout]
    last = next(r for r in runs if "spin/margin" in r["metrics"])  # the last pipeline stage's
    assert last["metrics"]["actor/num_updates"] == 4
    assert last["metrics"]["actor/grad_norm"] == pytest.approx(sum(want["norms"]) / 4, rel=1e-5)
    for run in runs:
        for name, w in want["weights"].items():
            torch.testing.assert_close(run["weights"][name], w, atol=1e-6, rtol=0, msg=name)
    # the steps moved the weights: equal above is not "nothing happened"
    first = spin_runs["reference"]["dp1"]["weights"] if dp == 2 else spin_runs["reference"]["dp2"]["weights"]
    assert any(not torch.equal(first[k], w) for k, w in want["weights"].items())


def _workers_on_rank(rank, model_path, ckpt):
    """The actor's reference refresh, then (on a fresh mesh) the PRM: one process for both."""
    from megatron.core import parallel_state as ps

    out = {"refresh": _refresh_on_rank(rank, model_path, free_port(), f"{ckpt}/actor")}
    ps.destroy_model_parallel()
    out["prm"] = _prm_on_rank(rank, model_path, free_port(), f"{ckpt}/prm")
    return out


@pytest.fixture(scope="module")
def worker_runs(tiny_model_path, tmp_path_factory):
    return run_ranks(_workers_on_rank, 1, tiny_model_path, str(tmp_path_factory.mktemp("recipes")))[0]


def test_refresh_ref_copies_the_actor_and_checkpoints_it(worker_runs):
    out = worker_runs["refresh"]
    mask = spin_rows()["response_mask"].bool()
    lp, ref = out["before"]
    assert (lp - ref)[mask].abs().max() > 1e-3  # the update moved the actor away from the reference
    lp, ref = out["after"]
    torch.testing.assert_close(ref, lp, atol=0, rtol=0)
    assert out["refresh"]["ref/refresh_bytes"] > 0
    assert (out["moved_on"] - ref)[mask].abs().max() > 1e-3
    torch.testing.assert_close(out["restored"][1], ref, atol=0, rtol=0)  # the refreshed reference came back
    torch.testing.assert_close(out["restored"][0], lp, atol=0, rtol=0)


def test_the_prm_learns_its_labels_and_resumes(worker_runs):
    out = worker_runs["prm"]
    losses = [m["prm/loss"] for m in out["metrics"]]
    assert losses[0] == pytest.approx(0.6931, abs=1e-3)  # log 2: the PRM starts as its reference
    assert losses[5] < 0.5 * losses[0], losses
    assert out["metrics"][5]["prm/accuracy"] == 1.0
    mask = spin_rows()["response_mask"].bool()
    assert (out["saved"] - out["ref"])[mask].abs().max() > 1e-2  # its weights moved
    assert (out["moved"] - out["saved"])[mask].abs().max() > 1e-4
    torch.testing.assert_close(out["restored"], out["saved"], atol=0, rtol=0)
    # the optimizer resumed too: the same update again gives the same loss
    assert out["after_resume"]["prm/loss"] == pytest.approx(out["metrics"][6]["prm/loss"], rel=1e-6)
