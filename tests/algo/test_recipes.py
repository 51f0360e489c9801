"""The recipes' math against hand computations in float64: SPPO's win-rate targets and loss, SPIN's
pairwise loss, PRIME's implicit rewards, PRM loss and advantages; the row weights a coupled loss
trains through give its exact gradient; whole groups per mini-batch and per rank."""

import math

import pytest
import torch

from megarl.algo import compute_advantages
from megarl.algo.prime import accuracy_band, implicit_process_rewards, outcome_labels, prm_metrics
from megarl.algo.sequence_losses import SequenceLossConfig, get_sequence_loss, sequence_log_ratio
from megarl.data.balance import balance_groups_across_ranks

torch.set_num_threads(1)
F64 = torch.float64


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def _tokens(seed: int, rows: int = 5, width: int = 4):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, width, generator=g, dtype=F64) * 3
    ref = -torch.rand(rows, width, generator=g, dtype=F64) * 3
    mask = torch.ones(rows, width, dtype=F64)
    mask[1, 2:] = 0
    mask[3, 1:] = 0
    return lp, ref, mask


def _row_sums(lp, ref, mask) -> list[float]:
    return [sum((lp[i, t] - ref[i, t]).item() for t in range(lp.shape[1]) if mask[i, t]) for i in range(len(lp))]


# ------------------------------------------------------------------ SPPO
def test_sppo_targets_are_bradley_terry_win_rates_over_the_group():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.5, 2.0, 7.0])
    groups = ["a", "a", "a", "b", "b", "c"]
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0], [1, 1]])
    adv, ret = compute_advantages("sppo", scores, mask, groups, sppo_eta=3.0, bt_scale=2.0)
    members = {"a": [0, 1, 2], "b": [3, 4], "c": [5]}
    for i, g in enumerate(groups):
        p = sum(_sigmoid(2.0 * (scores[i].item() - scores[k].item())) for k in members[g]) / len(members[g])
        assert ret[i, 0].item() == pytest.approx(p, rel=1e-6)
        assert adv[i, 0].item() == pytest.approx(3.0 * (p - 0.5), rel=1e-6, abs=1e-7)
        assert (adv[i][mask[i] == 0] == 0).all()
    assert adv[5].abs().max() == 0  # alone: P = 1/2


def test_sppo_loss_and_gradient_equal_the_hand_computation():
    lp, ref, mask = _tokens(0)
    targets = torch.tensor([0.5, -1.0, 2.0, 0.0, -0.25], dtype=F64)
    adv = targets.unsqueeze(1) * mask  # the estimator broadcasts its target over the response
    lp.requires_grad_(True)
    loss = get_sequence_loss("sppo")
    value, units, metrics = loss.fn(
        sequence_log_ratio(lp, ref, mask), cfg=SequenceLossConfig(), advantages=adv, response_mask=mask
    )
    value.backward()
    sums = _row_sums(lp.detach(), ref, mask)
    assert value.item() == pytest.approx(sum((s - t) ** 2 for s, t in zip(sums, targets.tolist())), rel=1e-12)
    assert units.item() == 5
    for i in range(5):  # d/d lp_it of (sum_t (lp - ref) - target)^2 = 2 (sum - target) on the mask
        want = 2 * (sums[i] - targets[i].item())
        for t in range(4):
            assert lp.grad[i, t].item() == pytest.approx(want * mask[i, t].item(), rel=1e-12, abs=1e-15)
    assert metrics["sppo/log_ratio"] == pytest.approx(sum(sums) / 5)


# ------------------------------------------------------------------ SPIN
def _spin_inputs():
    lp, ref, mask = _tokens(1, rows=6)
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    chosen = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # any position in the group
    return lp, ref, mask, group, chosen


def test_spin_loss_and_gradient_equal_the_hand_computation():
    lp, ref, mask, group, chosen = _spin_inputs()
    beta = 0.7
    lp.requires_grad_(True)
    value, units, metrics = get_sequence_loss("spin").fn(
        sequence_log_ratio(lp, ref, mask), cfg=SequenceLossConfig(spin_beta=beta), group_index=group, chosen=chosen
    )
    value.backward()
    d = _row_sums(lp.detach(), ref, mask)
    pairs = [(1, 0), (1, 2), (3, 4), (3, 5)]
    assert value.item() == pytest.approx(sum(_softplus(-beta * (d[c] - d[s])) for c, s in pairs), rel=1e-12)
    assert units.item() == 4
    grad = [0.0] * 6  # d softplus(-b m)/dm = -b sigmoid(-b m); m = d_c - d_s
    for c, s in pairs:
        g = -beta * _sigmoid(-beta * (d[c] - d[s]))
        grad[c] += g
        grad[s] -= g
    for i in range(6):
        for t in range(4):
            assert lp.grad[i, t].item() == pytest.approx(grad[i] * mask[i, t].item(), rel=1e-10, abs=1e-15)
    assert metrics["spin/margin"] == pytest.approx(sum(d[c] - d[s] for c, s in pairs) / 4)
    assert metrics["spin/pair_accuracy"] == sum(d[c] > d[s] for c, s in pairs) / 4


def test_spin_refuses_groups_it_cannot_pair():
    lp, ref, mask, group, chosen = _spin_inputs()
    fn, cfg = get_sequence_loss("spin").fn, SequenceLossConfig()
    with pytest.raises(ValueError, match="no chosen row"):
        fn(sequence_log_ratio(lp, ref, mask), cfg=cfg, group_index=group, chosen=torch.tensor([0.0, 1, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="more than one chosen"):
        fn(sequence_log_ratio(lp, ref, mask), cfg=cfg, group_index=group, chosen=torch.tensor([1.0, 1, 0, 1, 0, 0]))


def test_coupled_row_weights_give_the_exact_gradient_in_any_micro_batch_split():
    """The actor trains a coupled loss through per-row weights taken at the current log-probs,
    then sum_i w_i sum_t log pi over micro-batches cut anywhere; its gradient, over the row count
    Megatron divides by, equals the loss's own mean over its units."""
    from megarl.data.batch import Batch
    from megarl.engine.megatron.sequence_update import WEIGHTS, micro_batch_loss, row_weights

    lp, ref, mask, group, chosen = _spin_inputs()
    cfg = SequenceLossConfig(spin_beta=0.5)
    loss = get_sequence_loss("spin")
    mini = Batch(
        {"ref_log_probs": ref, "response_mask": mask, "group_index": group, "chosen": chosen, "old_log_probs": lp}
    )
    mini[WEIGHTS], metrics = row_weights(loss, cfg, lp, mini)
    x = lp.clone().requires_grad_(True)
    total, units = 0.0, 0.0
    for rows in ([0, 4], [1, 2, 3], [5]):  # micro-batches that split both groups
        part = mini[torch.tensor(rows)]
        value, n, _ = micro_batch_loss(loss, cfg, x[rows], part)
        total, units = total + value, units + float(n)
    (total / units).backward()
    y = lp.clone().requires_grad_(True)
    value, n, _ = loss.fn(sequence_log_ratio(y, ref, mask), cfg=cfg, group_index=group, chosen=chosen)
    (value / n).backward()
    assert torch.allclose(x.grad, y.grad, rtol=1e-6, atol=1e-12)  # the weights travel as float32
    assert metrics["actor/pg_loss"] == pytest.approx(value.item() / 4)
    # the weights must be taken at the current log-probs: stale ones give another gradient
    mini[WEIGHTS], _ = row_weights(loss, cfg, lp + 0.5 * torch.arange(6, dtype=F64).unsqueeze(1), mini)
    z = lp.clone().requires_grad_(True)
    value, n, _ = micro_batch_loss(loss, cfg, z, mini)
    (value / n).backward()
    assert not torch.allclose(z.grad, y.grad, rtol=1e-3)


def test_group_mini_batches_and_rank_balance_keep_groups_whole():
    from megarl.data.batch import Batch
    from megarl.engine.megatron.sequence_update import group_mini_batches

    group = torch.tensor([3, 3, 3, 1, 1, 1, 7, 7, 7, 0, 0, 0, 5, 5, 5])
    batch = Batch({"group_index": group, "row": torch.arange(15)})
    minis = group_mini_batches(batch, 2, torch.Generator().manual_seed(0))
    assert [len(m) for m in minis] in ([6, 9], [9, 6])
    seen = []
    for m in minis:
        rows = m["row"].tolist()
        for k in range(0, len(rows), 3):  # whole groups, each in its own order
            assert rows[k : k + 3] == list(range(rows[k], rows[k] + 3)) and rows[k] % 3 == 0
        seen += rows
    assert sorted(seen) == list(range(15))

    lengths = [9, 9, 9, 1, 1, 1, 8, 8, 8, 1, 1, 1]
    order = balance_groups_across_ranks(lengths, ["a"] * 3 + ["b"] * 3 + ["c"] * 3 + ["d"] * 3, 2)
    halves = [order[:6], order[6:]]
    assert sorted(order) == list(range(12))
    for half in halves:
        assert all(len({i // 3 for i in half[k : k + 3]}) == 1 for k in (0, 3))  # whole groups
    assert max(sum(lengths[i] for i in h) for h in halves) == 30  # {a, b} | {c, d} (not {a, c})
    with pytest.raises(ValueError, match="groups whole"):
        balance_groups_across_ranks([1] * 9, ["a"] * 3 + ["b"] * 3 + ["c"] * 3, 2)


# ------------------------------------------------------------------ PRIME
def test_implicit_rewards_and_the_prm_loss_equal_the_hand_computation():
    lp, ref, mask = _tokens(2)
    beta = 0.3
    r = implicit_process_rewards(lp, ref, mask, beta)
    for i in range(5):
        for t in range(4):
            want = beta * (lp[i, t] - ref[i, t]).item() * mask[i, t].item()
            assert r[i, t].item() == pytest.approx(want, rel=1e-6, abs=1e-7)
    labels = outcome_labels(torch.tensor([1.0, 0.0, 0.99, 1.0, 2.0]), threshold=1.0)
    assert labels.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    x = lp.clone().requires_grad_(True)
    value, units, metrics = get_sequence_loss("prime_ce").fn(
        sequence_log_ratio(x, ref, mask), cfg=SequenceLossConfig(prm_beta=beta), prm_labels=labels
    )
    value.backward()
    d = _row_sums(lp, ref, mask)
    want = -sum(
        y * math.log(_sigmoid(beta * s)) + (1 - y) * math.log(1 - _sigmoid(beta * s))
        for s, y in zip(d, labels.tolist())
    )
    assert value.item() == pytest.approx(want, rel=1e-12)
    for i in range(5):  # d BCE / d logit = sigmoid(logit) - y; d logit / d lp_it = beta on the mask
        g = beta * (_sigmoid(beta * d[i]) - labels[i].item())
        assert x.grad[i].tolist() == pytest.approx([g * m for m in mask[i].tolist()], rel=1e-10, abs=1e-15)
    assert metrics["prm/accuracy"] == sum((s > 0) == (y == 1) for s, y in zip(d, labels.tolist())) / 5
    m = prm_metrics(r, labels, mask)
    assert m["prm/sequence_reward_mean"] == pytest.approx(beta * sum(d) / 5, rel=1e-5)


def test_prime_advantages_equal_the_hand_computation():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=F64)
    process = torch.tensor(
        [[0.1, -0.2, 0.3], [0.4, 0.0, 0.0], [-0.5, 0.0, 0.0], [0.2, 0.2, 0.2], [9.0, 9.0, 0.0]], dtype=F64
    )
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0], dtype=F64)
    groups = ["a", "a", "a", "b", "c"]  # "b" and "c" alone: no baseline, no advantage
    pc, oc, gamma = 2.0, 3.0, 0.9
    adv, ret = compute_advantages(
        "prime", scores, mask, groups, process_rewards=process, gamma=gamma, process_coef=pc, outcome_coef=oc
    )
    means = [sum(process[i, : int(mask[i].sum())].tolist()) / mask[i].sum().item() for i in range(3)]
    want = torch.zeros(5, 3, dtype=F64)
    for i in range(3):
        others = [k for k in range(3) if k != i]
        n = int(mask[i].sum())
        reward = [pc * (process[i, t].item() - sum(means[k] for k in others) / 2) for t in range(n)]
        reward[-1] += oc * (scores[i].item() - sum(scores[k].item() for k in others) / 2)
        g = 0.0
        for t in reversed(range(n)):
            g = reward[t] + gamma * g
            want[i, t] = g
    assert torch.allclose(ret, want, rtol=1e-12, atol=1e-12)
    valid = mask.bool()
    mean, std = want[valid].mean(), want[valid].std()  # unbiased, as every whitening here
    assert torch.allclose(adv[valid], (want[valid] - mean) / torch.sqrt(std**2 + 1e-8), rtol=1e-9, atol=1e-12)


def test_the_accuracy_band_keeps_prompts_neither_always_nor_never_solved():
    labels = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0, 1, 0])
    uids = ["a"] * 3 + ["b"] * 3 + ["c"] * 2 + ["d"] * 2
    keep = accuracy_band(labels, uids, 0.2, 0.8)
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 2 + [True] * 2
