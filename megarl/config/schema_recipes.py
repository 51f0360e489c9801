"""The recipes' options under `algorithm`: SPPO, SPIN and PRIME (docs/algorithms.md).

    algorithm.adv_estimator: sppo  + actor.policy_loss: sppo    SPPO  (algorithm.sppo)
    actor.policy_loss: spin                                      SPIN  (algorithm.spin)
    algorithm.adv_estimator: prime                               PRIME (algorithm.prime, the prm section)

SPIN and SPPO train against the reference policy, refreshed from the actor every
`ref.update_every` steps (the previous round's / iterate's model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarl.config.schema_parts import OffloadConfig, OptimConfig, ParallelConfig, Recompute


@dataclass
class SppoConfig:
    # the loss's target log-ratio to the previous iterate: eta * (P(win) - 1/2); the paper's eta is
    # large for long responses (its log-ratios sum hundreds of tokens), a few nats suit short ones
    eta: float = 1.0
    # the preference model over a prompt's samples: P(y beats y') = sigmoid(bt_scale * (s - s'))
    # (Bradley-Terry on the step's scores: a rule reward's or a reward model's)
    bt_scale: float = 1.0


@dataclass
class SpinConfig:
    # the logistic loss's scale (the paper's lambda): softplus(-beta * (chosen - sample log-ratio))
    beta: float = 0.1


@dataclass
class PrimeConfig:
    beta: float = 0.05  # the implicit reward's scale: r_t = beta * (log pi_prm - log pi_ref)
    process_coef: float = 5.0  # the process rewards' weight in the advantage (after their baseline)
    outcome_coef: float = 5.0  # the outcome score's weight
    label_threshold: float = 1.0  # a score at or above it labels the response correct (the PRM's target)
    # when the PRM learns the step's labels: before it scores the rows (the paper's order), after,
    # or never (a frozen PRM: its initial weights, the policy's)
    update: Literal["before", "after", "none"] = "before"
    # [low, high]: train only on prompts whose share of correct samples lies in it (the paper's
    # [0.2, 0.8]), generating further prompt batches until data.train_batch_size are in (as
    # algorithm.filter_groups does); null: every prompt
    accuracy_band: list[float] | None = None


@dataclass
class PrmModelConfig:
    path: str | None = None  # HF checkpoint the implicit PRM starts from; None: the policy's


@dataclass
class PrmConfig:
    """PRIME's implicit process reward model (algorithm.adv_estimator=prime): a causal LM of its
    own, a worker group colocated with the actor ranks (cluster.num_actor_ranks of them), with its
    own layout and optimizer, trained on the outcome labels each step and checkpointed."""

    model: PrmModelConfig = field(default_factory=PrmModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    micro_batch_size: int = 32  # rows per forward/backward on one data-parallel rank
    mini_batch_size: int = 256  # rows per optimizer step (all data-parallel ranks)
    epochs: int = 1  # passes over each step's rows
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    recompute: Recompute = "none"
    seed: int = 0
