"""Advantage estimators: a registry of pure tensor functions (`algorithm.adv_estimator`).

    adv, returns = compute_advantages("rloo", scores, response_mask, uids)

Every estimator takes what it needs by parameter name, from
    scores               (B,)   per-row scores (token-level rewards summed inside the mask)
    token_level_rewards  (B, R) rewards per response token (a 1-D score lands on the row's last
                                response token; KL-in-reward, when on, is already in them)
    response_mask        (B, R) 1 on the model's tokens
    group_index          (B,)   dense 0..G-1 from the per-row `uid`s (rows of one prompt share it)
    values               (B, R) the critic's values (gae)
    baseline_scores      (B,)   the greedy rollout's score for the row's prompt (remax)
    process_rewards      (B, R) an implicit PRM's token rewards (prime, algo/prime.py)
plus the options gamma, lam, norm_by_std, eps (and process_coef, outcome_coef for prime;
sppo_eta, bt_scale for sppo, algo/self_play.py), and returns (advantages, returns), both (B, R) and
exactly 0 where response_mask is 0. Arithmetic is float64 inside; outputs have the dtype of the
rewards (float32 for integer rewards).

Conventions (verl's core_algos, with three deliberate differences): a prompt that has a single
sample (a group of 1) gets advantage 0 under grpo, dr_grpo, rloo, opo and
reinforce_plus_plus_baseline (verl passes such a row's raw score through); a group whose scores
are all equal gets 0 before any batch whitening; an empty response (mask all 0) gets 0 and never
NaN. Token-level recurrences (reinforce_plus_plus, gae) carry their running value through
positions the mask excludes (tool output in a multi-turn row) instead of restarting there; for
right-padded rows this is the same as verl. Whitening uses the unbiased variance over the batch's
response tokens and 1e-8 inside the square root, as verl and trl do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

INPUTS = (
    "scores",
    "token_level_rewards",
    "response_mask",
    "group_index",
    "values",
    "baseline_scores",
    "process_rewards",
)
OPTIONS = ("gamma", "lam", "norm_by_std", "eps", "process_coef", "outcome_coef", "sppo_eta", "bt_scale")
WHITEN_EPS = 1e-8


@dataclass(frozen=True)
class Estimator:
    name: str
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    inputs: tuple[str, ...]  # the INPUTS its function takes
    options: tuple[str, ...]  # the OPTIONS its function takes

    @property
    def score_only(self) -> bool:
        """Needs nothing beyond rewards/scores, the mask and the group ids (no critic, no baseline
        rollout, no process reward model)."""
        return not {"values", "baseline_scores", "process_rewards"} & set(self.inputs)


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str) -> Callable:
    """Decorator: add `fn` to ESTIMATORS under `name`; its parameters must be INPUTS or OPTIONS."""

    def add(fn: Callable) -> Callable:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        params = list(inspect.signature(fn).parameters)
        unknown = [p for p in params if p not in INPUTS + OPTIONS]
        if unknown or "response_mask" not in params:
            raise TypeError(
                f"estimator {name!r}: parameters must be among {INPUTS + OPTIONS} and include "
                f"response_mask; got unknown {unknown}"
            )
        ESTIMATORS[name] = Estimator(
            name, fn, tuple(p for p in params if p in INPUTS), tuple(p for p in params if p in OPTIONS)
        )
        return fn

    return add


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence | np.ndarray | None = None,
    *,
    values: torch.Tensor | None = None,
    baseline_scores: torch.Tensor | None = None,
    process_rewards: torch.Tensor | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of estimator `name`, each (B, R) and 0 outside response_mask.

    rewards: (B,) per-row scores or (B, R) token-level rewards. group_ids: one uid per row (any
    hashables). options: the OPTIONS; an estimator ignores those it does not take.
    """
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(ESTIMATORS)}")
    bad = sorted(set(options) - set(OPTIONS))
    if bad:
        raise TypeError(f"unknown advantage options {bad}; known: {list(OPTIONS)}")
    est = ESTIMATORS[name]
    if response_mask.dim() != 2 or response_mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"response_mask must be (batch, response_len) with batch={rewards.shape[0]}, "
            f"got {tuple(response_mask.shape)}"
        )
    if rewards.dim() == 2 and rewards.shape != response_mask.shape:
        raise ValueError(
            f"token-level rewards {tuple(rewards.shape)} and response_mask {tuple(response_mask.shape)} differ in shape"
        )
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    given = {
        "response_mask": response_mask,
        "values": values,
        "baseline_scores": baseline_scores,
        "process_rewards": process_rewards,
    }
    kwargs = {}
    for key in est.inputs:
        if key == "scores":
            kwargs[key] = row_scores(rewards, response_mask)
        elif key == "token_level_rewards":
            kwargs[key] = token_level_rewards(rewards, response_mask)
        elif key == "group_index":
            if group_ids is None:
                raise ValueError(f"advantage estimator {name!r} compares rows of one prompt: pass group_ids")
            kwargs[key] = _group_index(group_ids, rewards.shape[0]).to(rewards.device)
        elif given[key] is None:
            raise ValueError(f"advantage estimator {name!r} needs {key}")
        else:
            kwargs[key] = given[key]
    kwargs.update({k: v for k, v in options.items() if k in est.options})
    adv, returns = est.fn(**kwargs)
    return adv.to(rewards.dtype), returns.to(rewards.dtype)


# ------------------------------------------------------------------ helpers
def _group_index(group_ids: Sequence | np.ndarray, num_rows: int) -> torch.Tensor:
    """Map arbitrary hashable group ids to dense integers 0..G-1 (row order preserved)."""
    ids = list(group_ids)
    if len(ids) != num_rows:
        raise ValueError(
            f"group_ids has {len(ids)} entries but there are {num_rows} rows; "
            "pass one uid per row (repeat_interleave the prompt uids)"
        )
    dense: dict = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in ids], dtype=torch.long)


def row_scores(rewards: torch.Tensor, response_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row scalar score: rewards as given if 1-D, else the masked sum over response tokens."""
    if rewards.dim() == 1:
        return rewards
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (batch,) or (batch, response_len), got {tuple(rewards.shape)}")
    mask = torch.ones_like(rewards) if response_mask is None else response_mask.to(rewards.dtype)
    return (rewards * mask).sum(dim=-1)


def token_level_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B, R) rewards: as given (masked) if 2-D; a 1-D score goes on the row's last response token
    (an empty response has none, so its score is dropped)."""
    mask = response_mask.to(rewards.dtype)
    if rewards.dim() == 2:
        return rewards * mask
    width = mask.shape[1]
    last = width - 1 - torch.flip(mask, dims=[1]).argmax(dim=1)  # last position with mask 1
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0]), last] = rewards
    return out * mask


def _group_stats(values: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None = None):
    """Per row: its group's size, and the (weighted) sum of values and of weights over the group."""
    num_groups = int(index.max()) + 1 if index.numel() else 0
    w = torch.ones_like(values) if weights is None else weights
    zeros = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    counts = zeros.index_add(0, index, torch.ones_like(values))
    sums = zeros.index_add(0, index, w * values)
    wsums = zeros.index_add(0, index, w)
    return counts[index], sums[index], wsums[index]


def _broadcast(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return per_row.unsqueeze(-1) * response_mask.to(per_row.dtype)


def masked_whiten(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries (unbiased var), 0 outside the mask;
    fewer than two valid tokens give var 0, no valid token gives all 0."""
    mask = response_mask.to(values.dtype)
    n = mask.sum()
    if n == 0:
        return torch.zeros_like(values)
    mean = (values * mask).sum() / n
    centered = (values - mean) * mask
    var = (centered * centered).sum() / (n - 1) if n > 1 else torch.zeros_like(n)
    return centered * torch.rsqrt(var + WHITEN_EPS)


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float64)


# ------------------------------------------------------------------ score-only estimators
def group_normalized_scores(
    scores: torch.Tensor, group_ids: Sequence | np.ndarray, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """(score - group mean) [/ (group std + eps)] per row; rows alone in their group get 0.

    The std is the unbiased (Bessel-corrected) sample std, the usual GRPO choice. A group whose
    scores are all equal has std 0 and therefore advantage 0: it carries no learning signal.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (one per row), got shape {tuple(scores.shape)}")
    index = _group_index(group_ids, scores.shape[0]).to(scores.device)
    adv = _group_normalized(scores, index, norm_by_std, eps)
    return adv.to(scores.dtype if scores.is_floating_point() else torch.float32)


def _group_normalized(scores: torch.Tensor, index: torch.Tensor, norm_by_std: bool, eps: float):
    values = _f64(scores)
    counts, sums, _ = _group_stats(values, index)
    centered = values - sums / counts
    _, sq, _ = _group_stats(centered * centered, index)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    adv = centered / (std + eps) if norm_by_std else centered
    return torch.where(counts > 1, adv, torch.zeros_like(adv))


@register_estimator("grpo")
def grpo(scores, response_mask, group_index, norm_by_std=True, eps=1e-6):
    """(s - group mean) / (group std + eps), unbiased std; algorithm.norm_adv_by_std=false drops the
    division (then equal to dr_grpo). Returns = advantages."""
    adv = _group_normalized(scores, group_index, norm_by_std, eps).to(scores.dtype)
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register_estimator("dr_grpo")
def dr_grpo(scores, response_mask, group_index):
    """Dr. GRPO (arXiv 2503.20783): s - group mean, no division by the std. Its other half, no
    normalisation by response length, is the loss aggregation: pair it with
    actor.loss_agg_mode=seq-mean-token-sum."""
    adv = _broadcast(_group_normalized(scores, group_index, False, 0.0), response_mask)
    return adv, adv


@register_estimator("rloo")
def rloo(scores, response_mask, group_index):
    """REINFORCE leave-one-out: s_i - mean of the other n-1 samples of the prompt
    (= n/(n-1) * (s_i - group mean), verl's scaling)."""
    s = _f64(scores)
    counts, sums, _ = _group_stats(s, group_index)
    adv = torch.where(counts > 1, s - (sums - s) / (counts - 1).clamp(min=1), torch.zeros_like(s))
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register_estimator("opo")
def opo(scores, response_mask, group_index):
    """OPO (arXiv 2505.23585): s_i - b with the length-weighted baseline b = sum_j L_j s_j / sum_j L_j
    over the prompt's samples (L = response tokens); a group of only empty responses uses the plain mean."""
    s = _f64(scores)
    lengths = _f64(response_mask).sum(dim=-1)
    counts, weighted, total_len = _group_stats(s, group_index, lengths)
    _, sums, _ = _group_stats(s, group_index)
    baseline = torch.where(total_len > 0, weighted / total_len.clamp(min=1), sums / counts)
    adv = torch.where(counts > 1, s - baseline, torch.zeros_like(s))
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(scores, response_mask, group_index):
    """REINFORCE++ with a baseline (arXiv 2501.03262): s - group mean, broadcast over the response,
    then whitened over the batch's response tokens. A group whose scores are all equal is 0 before
    the whitening, which then moves it by the batch's token-weighted mean like every row."""
    adv = _broadcast(_group_normalized(scores, group_index, False, 0.0), response_mask)
    adv = masked_whiten(adv, response_mask)
    return adv, adv


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_next over response tokens (excluded positions pass G through)."""
    running = torch.zeros_like(rewards[:, 0])
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = torch.where(m > 0, rewards[:, t] + gamma * running, running)
        out[:, t] = running * m
    return out


@register_estimator("reinforce_plus_plus")
def reinforce_plus_plus(token_level_rewards, response_mask, gamma=1.0):
    """REINFORCE++ (arXiv 2501.03262): the discounted return of the token-level reward (KL in the
    reward included when it is on), whitened over the batch's response tokens. Returns are the
    discounted returns before whitening."""
    mask = _f64(response_mask)
    returns = _discounted_returns(_f64(token_level_rewards), mask, gamma)
    return masked_whiten(returns, mask), returns


# ------------------------------------------------------------------ estimators with more inputs
@register_estimator("remax")
def remax(scores, response_mask, baseline_scores):
    """ReMax (arXiv 2310.10505): s minus the greedy rollout's score for the same prompt, broadcast
    over the response. Returns = the score broadcast."""
    s = _f64(scores)
    adv = _broadcast(s - _f64(baseline_scores), response_mask)
    return adv, _broadcast(s, response_mask)


@register_estimator("gae")
def gae(token_level_rewards, values, response_mask, gamma=1.0, lam=1.0):
    """Generalised advantage estimation (arXiv 1506.02438) with the critic's values:
    delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next; returns = A + V (before
    whitening; the value targets), advantages whitened over the batch's response tokens."""
    mask, r, v = _f64(response_mask), _f64(token_level_rewards), _f64(values) * _f64(response_mask)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    adv = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        m = mask[:, t]
        a = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
        next_adv = torch.where(m > 0, a, next_adv)
        next_value = torch.where(m > 0, v[:, t], next_value)
        adv[:, t] = a * m
    returns = (adv + v) * mask
    return masked_whiten(adv, mask), returns


# ------------------------------------------------------------------ recipes' estimators
@register_estimator("sppo")
def sppo(scores, response_mask, group_index, sppo_eta=1.0, bt_scale=1.0):
    """SPPO (arXiv 2405.00675): each sample's win probability against the policy, estimated over
    its prompt's K samples under a Bradley-Terry model of the scores,
    P_i = 1/K sum_k sigmoid(bt_scale * (s_i - s_k)) (k = i included: 1/2, as the paper's mean over
    the K samples); advantages = sppo_eta * (P_i - 1/2), the sppo loss's target log-ratio
    (algo/sequence_losses.py); returns = P_i. A group of 1 gets P = 1/2, advantage 0."""
    s = _f64(scores)
    wins = torch.sigmoid(bt_scale * (s.unsqueeze(1) - s.unsqueeze(0)))  # (B, B): row i beats row k
    same = (group_index.unsqueeze(1) == group_index.unsqueeze(0)).to(s.dtype)
    p = (wins * same).sum(1) / same.sum(1)
    return _broadcast(sppo_eta * (p - 0.5), response_mask), _broadcast(p, response_mask)


def _leave_one_out(per_row: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The mean of the other rows of each row's group (0 for a row alone in its group)."""
    counts, sums, _ = _group_stats(per_row, index)
    return torch.where(counts > 1, (sums - per_row) / (counts - 1).clamp(min=1), per_row)


@register_estimator("prime")
def prime(scores, process_rewards, response_mask, group_index, gamma=1.0, process_coef=5.0, outcome_coef=5.0):
    """PRIME (arXiv 2502.01456): leave-one-out baselines for both reward sources, then returns.
    A token's process reward (the implicit PRM's, algo/prime.py) minus the mean over the prompt's
    other samples of their mean token reward; the outcome score minus the other samples' mean
    score, on the last response token; each source weighted by its coefficient, summed, discounted
    into returns G_t and whitened over the batch's response tokens (the returns are G)."""
    mask, s, r = _f64(response_mask), _f64(scores), _f64(process_rewards)
    lengths = mask.sum(-1)
    mean_reward = (r * mask).sum(-1) / lengths.clamp(min=1)
    alone = _group_stats(s, group_index)[0] <= 1  # no other sample: no baseline, no advantage
    process = (r - _leave_one_out(mean_reward, group_index).unsqueeze(-1)) * mask
    outcome = token_level_rewards(s - _leave_one_out(s, group_index), mask)
    rewards = torch.where(alone.unsqueeze(-1), torch.zeros_like(r), process_coef * process + outcome_coef * outcome)
    returns = _discounted_returns(rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


def grpo_advantages(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence | np.ndarray,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages (B, R), zero where response_mask is 0 (compute_advantages("grpo", ...)[0])."""
    return compute_advantages("grpo", rewards, response_mask, group_ids, norm_by_std=norm_by_std, eps=eps)[0]
