"""The `reward` section of the run schema: rule / custom rewards, model rewards, overlong shaping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong shaping (megarl/reward/overlong.py): the last `len` tokens before
    rollout.max_new_tokens cost up to penalty_factor of the score, linearly."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0


@dataclass
class RewardModelConfig:
    """A model reward (megarl/reward/model.py): a remote scoring endpoint (remote.py), a
    generative judge behind an SGLang-API /generate (genrm.py), or a sequence-classification
    reward model scored by Ray workers (classifier.py)."""

    kind: Literal["none", "remote", "genrm", "classifier"] = "none"
    url: str | None = None  # remote: the scoring endpoint (POST); genrm: the judge
    # server; None with genrm: an embedded judge on `path`
    # genrm: the judge's HF folder (its chat template wraps the judge prompt; the embedded judge
    # loads it); classifier: the reward model's HF folder (an XForSequenceClassification, 1 label)
    path: str | None = None
    # classifier without `path`: a reward model built in code (megarl/reward/rm_presets.py), at
    # RUN_DIR/reward_model on first use and reused while its recipe is unchanged
    preset: str | None = None
    combine: Literal["replace", "add"] = "replace"  # score = model, or rule/custom + model
    on_failure: Literal["raise", "fallback"] = "raise"  # fallback: fallback_score, counted
    fallback_score: float = 0.0
    # remote: rows per POST; genrm: prompts per /generate; classifier: rows per forward on a rank
    batch_size: int = 64
    concurrency: int = 4  # requests in flight (and overlap scoring threads)
    timeout_s: float = 60.0  # per request
    max_retries: int = 3  # per request: transport errors, timeouts, 5xx
    # the model's scores before they are used (reward/normalize.py): none, batch (whitened over each
    # training batch), running (running mean / std of every training row so far); None: running
    # for classifier (a Bradley-Terry score has no fixed offset or scale), none otherwise
    normalize: Literal["none", "batch", "running"] | None = None
    # also score the rows with the rule / custom reward (not trained on with combine=replace) and
    # log it as reward/ground_truth_mean beside reward/mean; with combine=add it is always logged
    log_ground_truth: bool = False
    # classifier: its ranks on the actor pool's devices (a sliver of each, next to the actor ranks)
    # or on a pool of their own (num_workers devices)
    placement: Literal["colocated", "disaggregated"] = "colocated"
    num_workers: int | None = None  # classifier ranks; None: colocated one per actor device, else 1
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # classifier; auto: bfloat16 on a GPU
    # genrm: {prompt}, {response}, {ground_truth} are replaced; None = genrm.DEFAULT_TEMPLATE
    prompt_template: str | None = None
    score_pattern: str = r"\\boxed\{\s*([-+]?\d+(?:\.\d+)?)\s*\}"  # its last match's group 1
    score_min: float = 0.0  # the judge's scale; scores map to [0, 1]; outside: failure
    score_max: float = 10.0
    max_new_tokens: int = 256  # genrm: judge answer length (greedy)


@dataclass
class RewardConfig:
    custom_function: str | None = None  # "package.module:function"; None = rule by data_source
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    math_timeout_s: float = 5.0  # per answer for the math verifiers; over it: 0, counted
    math_workers: int = 4  # math verifier processes (started on first use)
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    # score each generation request's rows while the others still generate; None: on exactly
    # when reward.model.kind is not none
    overlap: bool | None = None
