"""PRIME's step phase (Cui et al. 2025, arXiv 2502.01456): the implicit PRM learns the step's
outcome labels and gives every response token a process reward.

    rows, metrics = process_rewards(loop, rows, step, timing)    # before the advantages

The outcome label of a row is 1 when its score reaches algorithm.prime.label_threshold. With
algorithm.prime.update = before (the paper's order) the PRM (engine/megatron/prm.py) first takes
one update on the rows' labels, then scores them; after: scores, then updates; none: only scores.
Its token rewards beta * (log pi_prm - log pi_ref) (the reference is the actor's, the initial
policy) go to the prime estimator as rows["process_rewards"] (algo/advantages.py). Logged: the
PRM's loss, accuracy and grad norm (prm/*), and the rewards' scale and their sequence sums'
accuracy against the labels on the rows they scored (prm/token_reward_*, prm/score_accuracy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl.algo.prime import accuracy_band, implicit_process_rewards, outcome_labels, prm_metrics
from megarl.data.batch import Batch
from megarl.trainer import finite
from megarl.trainer.step_metrics import average, timer

if TYPE_CHECKING:
    from megarl.trainer.step_loop import StepLoop


def process_rewards(loop: StepLoop, rows: Batch, step: int, timing: dict) -> tuple[Batch, dict]:
    cfg, prm = loop.cfg, loop.rt.prm
    p, t = cfg.algorithm.prime, cfg.rollout.temperature
    rows["prm_labels"] = outcome_labels(rows["raw_scores"], p.label_threshold)
    view = loop._trainer_view(rows, "ref_log_probs", "prm_labels")
    metrics: dict = {}

    def update() -> None:
        with timer(timing, "prm_update"):
            per_rank = prm.update_prm(view, cfg.prm.mini_batch_size, cfg.prm.epochs, t, cfg.trainer.seed + step)
        finite.check_ranks(per_rank, "prm update", step, loop.weight_version)
        metrics.update(average(per_rank))

    if p.update == "before":
        update()
    with timer(timing, "prm"):
        log_probs = prm.compute_prm_log_prob(view, t)["prm_log_probs"]
    rows["process_rewards"] = implicit_process_rewards(log_probs, rows["ref_log_probs"], rows["response_mask"], p.beta)
    if p.update == "after":
        update()
    metrics.update(prm_metrics(rows["process_rewards"], rows["prm_labels"], rows["response_mask"]))
    return rows, metrics


def accuracy_filter(cfg):
    """algorithm.prime.accuracy_band as dynamic sampling's group filter (dynamic_sampling.py), or None."""
    band = cfg.algorithm.prime.accuracy_band
    if cfg.algorithm.adv_estimator != "prime" or not band:
        return None
    threshold = cfg.algorithm.prime.label_threshold

    def keep(scores, uids):
        return accuracy_band(outcome_labels(scores, threshold), uids, band[0], band[1]).numpy()

    return keep
