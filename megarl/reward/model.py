"""The run's scorer: the rule (or custom) reward and a model reward, and scoring that overlaps generation.

reward.model.kind picks the model reward: none (the rule verifiers by data_source, or
reward.custom_function, as before), remote (remote.py: an HTTP endpoint, e.g. `python -m
megarl.reward.serve`), genrm (genrm.py: a judge LLM behind SGLang's /generate; with
reward.model.url null an embedded judge server is started on reward.model.path by
`reward_model_server`) or classifier (classifier.py: a sequence-classification reward model on a
Ray worker group the runtime starts). reward.model.combine: `replace` scores with the model alone
(the data_source registry is consulted only for reward/ground_truth_mean, with
reward.model.log_ground_truth); `add` adds the model's score to the rule's.

The model's scores are normalised (reward.model.normalize, normalize.py) over a whole batch, after
its pieces are scored: training batches (score_batch / score_columns with train=True, and the
overlap's collect) update the statistics, validation and ReMax's baselines (train=False) do not.

A row the model could not score (a Failure: the endpoint's null, an unparsable judge answer, a
request that failed after its retries) raises a RewardError naming the row, its data_source and
the reason (on_failure=raise, the default), or with on_failure=fallback scores fallback_score
and is counted: reward/model_failures (reward/model_unparsable of them: the judge answered
without a readable score), logged every step, the first one of a run also as a warning.

Overlap (reward.overlap; auto: on with a model reward): RolloutManager.generate calls
`OverlapScoring.on_rows` (overlap.py) as each /generate request finishes, and its rows are scored
in worker threads while the other requests still generate; `collect` waits for the rest after
generation.
The granularity is one request: one per prompt behind a router, one per engine's share of the
batch otherwise (a single engine: one request, so nothing to overlap). perf/reward_scoring_s is
the wall time during which any scoring ran, perf/reward_hidden_s the part of it before
generation finished (hidden behind it), perf/reward_s (the trainer's) what was left to wait for.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from megarl.config.validate_reward import default_normalize
from megarl.reward.normalize import ScoreNormalizer
from megarl.reward.registry import RewardError
from megarl.reward.remote import Failure
from megarl.reward.rows import RowColumns, Scored
from megarl.reward.rule import _short, make_reward_function, score_rows

if TYPE_CHECKING:
    from megarl.reward.overlap import OverlapScoring

log = logging.getLogger(__name__)


def prompt_text(prompt) -> str:
    """A prompt as text: the content of a single message, else "role: content" lines."""
    if isinstance(prompt, str):
        return prompt
    messages = [dict(m) for m in prompt]
    if len(messages) == 1:
        return str(messages[0].get("content", ""))
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in messages)


def make_reward_model(m, judge_url: str | None = None, workers=None, policy_tokenizer=None):
    """The model reward of reward.model `m` (RewardModelConfig), or None for kind=none. `workers`:
    the classifier's ClassifierWorkers (started by the runtime)."""
    common = dict(batch_size=m.batch_size, concurrency=m.concurrency, timeout_s=m.timeout_s, max_retries=m.max_retries)
    if m.kind == "none":
        return None
    if m.kind == "classifier":
        from megarl.reward.classifier import ClassifierReward

        if workers is None:
            raise RewardError("reward.model.kind=classifier needs its worker group (started by the run's runtime)")
        return ClassifierReward(workers, policy_tokenizer)
    if m.kind == "remote":
        from megarl.reward.remote import RemoteReward

        return RemoteReward(m.url, **common)
    from megarl.reward.genrm import GenerativeReward

    url = m.url or judge_url
    if url is None:
        raise RewardError(
            "reward.model.kind=genrm needs a judge: set reward.model.url (an SGLang-API "
            "server) or reward.model.path (an embedded judge is started on it)"
        )
    return GenerativeReward(
        url,
        template=m.prompt_template,
        score_pattern=m.score_pattern,
        score_min=m.score_min,
        score_max=m.score_max,
        max_new_tokens=m.max_new_tokens,
        tokenizer_path=m.path,
        **common,
    )


@contextlib.contextmanager
def reward_model_server(m, run_dir):
    """The embedded judge server's URL for genrm without reward.model.url (started on
    reward.model.path, stopped on exit); None otherwise."""
    if m.kind != "genrm" or m.url is not None:
        yield None
        return
    from megarl.rollout.fleet.server_process import RolloutServerProcess

    with RolloutServerProcess(
        m.path, max_batch_size=max(m.batch_size, 1), torch_threads=1, log_path=run_dir / "judge_server.log"
    ) as server:
        yield server.url


class RowScorer:
    """Scores rows (RowColumns or a rollout Batch); thread-safe for the overlap's workers."""

    def __init__(self, reward_cfg, judge_url: str | None = None, workers=None, policy_tokenizer=None):
        r, m = reward_cfg, reward_cfg.model
        self.reward_fn = make_reward_function(
            r.custom_function, math_timeout_s=r.math_timeout_s, math_workers=r.math_workers
        )
        self.model = make_reward_model(m, judge_url, workers, policy_tokenizer)
        self.add_rule = self.model is None or m.combine == "add"  # the rule's score is part of the reward
        self.use_rule = self.add_rule or m.log_ground_truth
        self.on_failure, self.fallback_score = m.on_failure, m.fallback_score
        self.normalizer = ScoreNormalizer(m.normalize or default_normalize(m.kind))
        self.overlap = r.overlap if r.overlap is not None else self.model is not None
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(m.concurrency, thread_name_prefix="reward") if self.overlap else None
        )
        self._lock = threading.Lock()
        self._warned = False
        self._reset()

    @classmethod
    def of_runtime(cls, runtime) -> RowScorer:
        """The scorer of a run's runtime: its config, and the judge server or reward-model workers
        and policy tokenizer it started (absent on a runtime without them)."""
        return cls(
            runtime.cfg.reward,
            getattr(runtime, "reward_model_url", None),
            getattr(runtime, "reward_workers", None),
            getattr(runtime, "tokenizer", None),
        )

    def _reset(self) -> None:
        self._failures = self._unparsable = self._model_n = self._rule_n = 0
        self._model_sum = self._rule_sum = 0.0
        self._intervals: list[tuple[float, float]] = []  # (start, end) of every scoring call
        self._generation_end: float | None = None

    # ---- scoring --------------------------------------------------------------------------------
    def score_batch(self, rows, train: bool = True) -> torch.Tensor:
        """Every row of a rollout Batch, after generation (no overlap). `train`: a training batch
        (it updates the normalisation statistics); validation and baselines pass False."""
        ids = self.model is not None and getattr(self.model, "needs_token_ids", False)
        cols = RowColumns(
            list(range(len(rows))),
            list(rows["data_source"]),
            list(rows["raw_prompt"]) if "raw_prompt" in rows.non_tensors else [""] * len(rows),
            list(rows["response_text"]),
            list(rows["ground_truth"]),
            list(rows["extra_info"]),
            *(batch_token_ids(rows) if ids else (None, None)),
        )
        return torch.as_tensor(self.score_columns(cols, train))

    def score_columns(self, cols: RowColumns, train: bool = True) -> np.ndarray:
        return self.finish(self.score_piece(cols), train)

    def score_piece(self, cols: RowColumns) -> Scored:
        """The rule's and the model's raw scores of some rows (the overlap scores pieces)."""
        start = time.perf_counter()
        try:
            return self._score(cols)
        finally:
            with self._lock:
                self._intervals.append((start, time.perf_counter()))

    def finish(self, scored: Scored, train: bool) -> np.ndarray:
        """A whole batch's rewards: the model's scores normalised over it (failed rows get
        fallback_score), then alone or added to the rule's."""
        if scored.model is None:
            return scored.rule
        model, ok = scored.model.copy(), ~scored.failed
        model[ok] = self.normalizer(model[ok], train)
        model[scored.failed] = self.fallback_score
        model = model.astype(np.float32)
        return scored.rule + model if self.add_rule else model

    def _score(self, cols: RowColumns) -> Scored:
        n = len(cols.rows)
        rule = None
        if self.use_rule:
            rule = np.asarray(
                score_rows(
                    self.reward_fn,
                    cols.data_sources,
                    cols.responses,
                    cols.ground_truths,
                    cols.extra_infos,
                    row_ids=cols.rows,
                ),
                dtype=np.float32,
            )
            with self._lock:
                self._rule_n, self._rule_sum = self._rule_n + n, self._rule_sum + float(rule.sum())
        if self.model is None:
            return Scored(rule, None, None)
        values = self.model.score(self._payload(cols))
        if len(values) != n:
            raise RewardError(f"reward model ({self.model.kind}) returned {len(values)} scores for {n} rows")
        failed = np.array([isinstance(v, Failure) for v in values], dtype=bool)
        for k in np.flatnonzero(failed):
            self._failed(cols, int(k), values[k])
        model = np.array([np.nan if f else float(v) for v, f in zip(values, failed)], dtype=np.float64)
        with self._lock:
            self._failures += int(failed.sum())
            self._unparsable += sum(bool(v.unparsable) for v in values if isinstance(v, Failure))
            self._model_n += int((~failed).sum())
            self._model_sum += float(model[~failed].sum())
        return Scored(rule, model, failed)

    def _payload(self, cols: RowColumns) -> list[dict]:
        """The rows as the model reward reads them (remote.py's contract; the token ids too for a
        model that reads them)."""
        payload = [
            {
                "data_source": d,
                "prompt": prompt_text(p),
                "messages": [dict(m) for m in p] if not isinstance(p, str) else [{"role": "user", "content": p}],
                "response": s,
                "ground_truth": g,
                "extra_info": e or {},
            }
            for d, p, s, g, e in zip(
                cols.data_sources, cols.prompts, cols.responses, cols.ground_truths, cols.extra_infos
            )
        ]
        if getattr(self.model, "needs_token_ids", False) and cols.prompt_ids is not None:
            for row, p, r in zip(payload, cols.prompt_ids, cols.response_ids):
                row["prompt_ids"], row["response_ids"] = p, r
        return payload

    def _failed(self, cols: RowColumns, k: int, failure: Failure) -> None:
        """A row the model could not score: raised (on_failure=raise), else warned about once."""
        where = (
            f"row {cols.rows[k]} (data_source {cols.data_sources[k]!r}, ground_truth {_short(cols.ground_truths[k])})"
        )
        if self.on_failure == "raise":
            raise RewardError(
                f"{where}: the reward model ({self.model.kind}) failed: {failure.reason}. "
                "Set reward.model.on_failure=fallback to score such rows "
                "reward.model.fallback_score and count them instead"
            )
        self._warn_once(f"{where}: the reward model ({self.model.kind}) failed: {failure.reason}")

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "%s; scored reward.model.fallback_score and counted in reward/model_failures (logged once per run)",
                message,
            )

    # ---- overlap --------------------------------------------------------------------------------
    def start_overlap(self, prompts, n: int) -> OverlapScoring | None:
        """An OverlapScoring for one generate call of `prompts` (n samples each); None when off."""
        from megarl.reward.overlap import OverlapScoring

        return OverlapScoring(self, prompts, n) if self.overlap else None

    # ---- metrics --------------------------------------------------------------------------------
    def take_metrics(self) -> dict[str, float]:
        """This step's model-reward and overlap metrics ({} with neither), reset."""
        if self.model is None and not self.overlap:
            return {}
        with self._lock:
            out: dict[str, float] = {}
            if self.model is not None:
                out.update(
                    {
                        "reward/model_failures": float(self._failures),
                        "reward/model_unparsable": float(self._unparsable),
                        **self.model.take_stats(),
                        **self.normalizer.metrics(),
                    }
                )
                if self._model_n:
                    out["reward/model_mean"] = self._model_sum / self._model_n
                if self._rule_n:
                    out["reward/ground_truth_mean"] = self._rule_sum / self._rule_n
            out["perf/reward_scoring_s"] = _union(self._intervals)
            if self._generation_end is not None:
                end = self._generation_end
                out["perf/reward_hidden_s"] = _union([(a, min(b, end)) for a, b in self._intervals if a < end])
            self._reset()
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.model is not None:
            self.model.close()


def batch_token_ids(rows) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's prompt ids and response ids up to its last model token (an agent trajectory's
    tool tokens inside included), from a rollout Batch's right-padded tensors."""
    mask = rows["response_mask"] > 0
    positions = torch.arange(1, mask.shape[1] + 1)
    ends = (positions * mask).amax(dim=1).tolist() if mask.shape[1] else [0] * len(rows)
    prompts = [ids[:n].tolist() for ids, n in zip(rows["input_ids"], rows["prompt_lengths"].tolist())]
    responses = [ids[:n].tolist() for ids, n in zip(rows["responses"], ends)]
    return prompts, responses


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
