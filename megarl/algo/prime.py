"""PRIME's implicit process reward (Cui et al. 2025, arXiv 2502.01456), as pure tensor functions.

An implicit PRM is a causal LM pi_phi trained only on outcome labels, with the sequence-level
reward beta * log(pi_phi(y) / pi_ref(y)) as the logit of "the response is correct" (the prime_ce
loss, algo/sequence_losses.py). Its token-level reward falls out of the same parametrisation:

    r_t = beta * (log pi_phi(y_t | y_<t) - log pi_ref(y_t | y_<t))

so every token gets a dense reward without any step labels. The prime estimator
(algo/advantages.py) turns r_t and the outcome score into advantages.
"""

from __future__ import annotations

import torch


def implicit_process_rewards(
    prm_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, response_mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """(B, R) beta * (log pi_phi - log pi_ref) at the response tokens, 0 elsewhere (float32)."""
    mask = response_mask.to(torch.float64)
    diff = prm_log_probs.to(torch.float64) - ref_log_probs.to(torch.float64)
    return (beta * diff * mask).to(torch.float32)


def outcome_labels(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B,) 1.0 where the outcome score is at least `threshold` (the answer counts as correct)."""
    return (scores.to(torch.float64) >= threshold).to(torch.float32)


def accuracy_band(labels: torch.Tensor, uids, low: float, high: float) -> torch.Tensor:
    """Row mask: True for rows whose prompt's share of correct samples lies in [low, high]
    (the reference implementation's accuracy filter: prompts always or never solved teach the
    PRM and the policy little)."""
    uids = list(uids)
    totals: dict = {}
    for u, y in zip(uids, labels.tolist()):
        n, k = totals.get(u, (0, 0.0))
        totals[u] = (n + 1, k + y)
    return torch.tensor([low <= totals[u][1] / totals[u][0] <= high for u in uids], dtype=torch.bool)


def prm_metrics(process_rewards: torch.Tensor, labels: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """The implicit rewards' scale and how well their sequence sums predict the outcome labels."""
    mask = response_mask.to(torch.float64)
    r = process_rewards.to(torch.float64) * mask
    total = r.sum(-1)
    tokens = mask.sum().clamp(min=1.0)
    return {
        "prm/token_reward_mean": float(r.sum() / tokens),
        "prm/token_reward_abs_mean": float(r.abs().sum() / tokens),
        "prm/sequence_reward_mean": float(total.mean()),
        "prm/score_accuracy": float(((total > 0).to(torch.float32) == labels).double().mean()),
    }
