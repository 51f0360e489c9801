"""A generative reward model: a judge LLM behind an SGLang-API /generate scores each response.

For each row the judge prompt is `reward.model.prompt_template` (default DEFAULT_TEMPLATE) with
{prompt}, {response} and {ground_truth} replaced (plain replacement, so other braces, a
\\boxed{N} included, stay as written); when the judge's HF folder is known (reward.model.path)
and its tokenizer has a chat template, the prompt is sent as one user turn of that template. The
prompts go out as SGLang's `text` input (the server tokenizes), greedy, `max_new_tokens` long,
`batch_size` prompts per /generate, through RolloutClient (its retries and backoff).

The score is read from the answer: the first group of the LAST match of `score_pattern` (the whole
match when the pattern has no group), a number on the judge's scale [score_min, score_max],
mapped linearly to [0, 1]. An answer with no match is `Failure(unparsable=True)`; a number
outside the scale and a request that failed for good are Failures too. None of them is ever
scored 0 silently: model.RowScorer raises a RewardError naming the row, or (on_failure=fallback)
scores it fallback_score and counts it (reward/model_failures, reward/model_unparsable).
"""

from __future__ import annotations

import concurrent.futures
import os
import re

from megarl.reward.remote import API_KEY_ENV, Failure
from megarl.rollout.client.client import RolloutClient, RolloutRequestError

DEFAULT_TEMPLATE = (
    "You are grading an answer to a problem.\n\n"
    "Problem:\n{prompt}\n\n"
    "Reference answer:\n{ground_truth}\n\n"
    "Answer to grade:\n{response}\n\n"
    "How correct is the answer, from 0 (wrong) to 10 (fully correct)? Give a one-sentence reason, "
    "then the score alone as \\boxed{N}."
)
PLACEHOLDERS = ("{prompt}", "{response}", "{ground_truth}")


def fill_template(template: str, row: dict) -> str:
    """The template with {prompt}, {response}, {ground_truth} replaced, in one pass (a response
    that itself contains "{ground_truth}" is not expanded)."""
    values = {"{prompt}": row["prompt"], "{response}": row["response"], "{ground_truth}": row["ground_truth"]}
    return re.sub("|".join(re.escape(p) for p in PLACEHOLDERS), lambda m: str(values[m.group(0)]), template)


def parse_score(answer: str, pattern: re.Pattern, low: float, high: float) -> float | Failure:
    """The judge's score mapped to [0, 1] (see the module doc), or a Failure saying why not."""
    matches = list(pattern.finditer(answer))
    match = matches[-1] if matches else None
    if match is None:
        return Failure(
            f"no match of score_pattern {pattern.pattern!r} in the judge's answer {answer[-160:]!r}", unparsable=True
        )
    text = match.group(1) if pattern.groups else match.group(0)
    try:
        value = float(text)
    except (TypeError, ValueError):
        return Failure(f"the judge's score {text!r} is not a number (answer ends {answer[-160:]!r})", unparsable=True)
    if not low <= value <= high:
        return Failure(
            f"the judge's score {value:g} is outside its scale [{low:g}, {high:g}] (reward.model.score_min / score_max)"
        )
    return (value - low) / (high - low)


class GenerativeReward:
    """Thread-safe: RolloutClient runs its requests on its own event loop thread."""

    kind = "genrm"

    def __init__(
        self,
        url: str,
        *,
        template: str | None = None,
        score_pattern: str = r"\\boxed\{\s*([-+]?\d+(?:\.\d+)?)\s*\}",
        score_min: float = 0.0,
        score_max: float = 10.0,
        max_new_tokens: int = 256,
        batch_size: int = 64,
        concurrency: int = 4,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        tokenizer_path: str | None = None,
        api_key: str | None = None,
    ):
        if not score_min < score_max:
            raise ValueError(f"score_min={score_min} must be < score_max={score_max}")
        self.template = template or DEFAULT_TEMPLATE
        self.pattern = re.compile(score_pattern)
        self.low, self.high, self.batch_size = score_min, score_max, batch_size
        self.params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
        # never the rollout engines' key (RolloutClient's default): the judge may be a third party
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
        self.client = RolloutClient(
            url, timeout_s=timeout_s, max_retries=max_retries, max_concurrency=concurrency, api_key=api_key
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="genrm")
        self._chat = None
        if tokenizer_path is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
            if getattr(tokenizer, "chat_template", None):
                self._chat = tokenizer
        self._retries_seen = 0

    def judge_prompt(self, row: dict) -> str:
        text = fill_template(self.template, row)
        if self._chat is None:
            return text
        return self._chat.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )

    def score(self, rows: list[dict]) -> list[float | Failure]:
        """One score in [0, 1] or Failure per row, in order."""
        batches = [rows[k : k + self.batch_size] for k in range(0, len(rows), self.batch_size)]
        return [s for part in self._pool.map(self._batch, batches) for s in part]

    def _batch(self, rows: list[dict]) -> list[float | Failure]:
        try:
            outputs = self.client.generate_text([self.judge_prompt(r) for r in rows], self.params)
        except RolloutRequestError as exc:
            return [Failure(f"the judge at {self.client.base_url} failed: {exc}")] * len(rows)
        return [parse_score(out.text, self.pattern, self.low, self.high) for out in outputs]

    def take_stats(self) -> dict[str, float]:
        retries = self.client.retries
        new, self._retries_seen = retries - self._retries_seen, retries
        return {"reward/model_retries": float(new)}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
