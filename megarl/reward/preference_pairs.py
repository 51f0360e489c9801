"""Preference pairs for reward-model training: (chosen, rejected, wins), two token sequences, each a
prompt and a response as the reward model will score them, and how often the first wins (1.0 a
preference, 0.5 a tie).

`digits_pairs`: made in code from the digits task's ground truth (megarl/data/tasks.py). For each
prompt, a response the task's own verifier scores 1 is preferred over one it scores 0. Responses
are token ids drawn from the policy's whole vocabulary, the way the tiny policy samples them
(rollout.max_new_tokens tokens, cut after an end-of-sequence token), and labelled by the verifier
on their decoded text (special and unknown ids decode to nothing, so "<|user|>7" answers 7):
the reward model learns the rule on the responses it will be shown, not on tidy strings.

Three kinds of pairs: a correct answer over a wrong one (any response the verifier scores 0); a
correct answer over the same response with its answer swapped for a wrong one (nothing but the
answer differs: without these, a model that ranked held-out pairs 99.5% right still preferred "55"
to the right "33" for some prompts); and ties (TIE_PAIRS of them), two responses the verifier
scores the same, both wrong or both right. Bradley-Terry on preferences alone leaves the order
among wrong answers to chance, and GRPO, whose early groups rarely hold a correct answer, climbs
that order: policies trained on such models settled on one answer for every prompt ("tt", "7").
A tie counts half a win each way (train_rm.py), so equally good responses are scored alike.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from megarl.data.tasks import make_digits_rows
from megarl.reward.classifier import chat_ids
from megarl.reward.rule import digits_score

# (chosen, rejected, how often chosen wins): 1.0 a preference, 0.5 a tie
Pair = tuple[list[int], list[int], float]
TIE_PAIRS = 0.3  # digits_pairs: the share of ties


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A prompt as the policy sees it: its chat template with the generation prompt."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def digits_pairs(tokenizer, vocab_size: int, num: int, seed: int = 0, max_response_tokens: int = 2) -> list[Pair]:
    """`num` pairs over the digits prompts of data seed `seed` (module doc)."""
    rng = random.Random(seed)
    digit = {d: tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    eos = tokenizer.eos_token_id
    # ids that decode to nothing: special tokens but the end of sequence, and ids past the vocabulary
    silent = [i for i in tokenizer.all_special_ids if i != eos] + list(range(len(tokenizer), vocab_size))

    def sample(first: list[int]) -> list[int]:
        """`first`, then random ids up to the length limit, cut after the first eos."""
        ids = list(first) + [rng.randrange(vocab_size) for _ in range(max(0, max_response_tokens - len(first)))]
        ids = ids[:max_response_tokens]
        return ids[: ids.index(eos) + 1] if eos in ids else ids

    def verified(ids: list[int], truth: str, want: float) -> bool:
        return digits_score(tokenizer.decode(ids, skip_special_tokens=True), truth, {}) == want

    def wrong_answer(truth: str, prompt: str) -> int:
        """Another digit (often one of the prompt's), or any id."""
        return rng.choice([digit[d] for d in "0123456789" + prompt if d != truth] + [rng.randrange(vocab_size)])

    def response(truth: str, prompt: str, correct: bool) -> list[int]:
        while True:
            head = [digit[truth] if correct else wrong_answer(truth, prompt)]
            if max_response_tokens > 1 and rng.random() < 0.25:
                head = [rng.choice(silent), *head]  # the answer behind a token that decodes to nothing
            ids = sample(head)
            if verified(ids, truth, 1.0 if correct else 0.0):
                return ids

    def swapped(chosen: list[int], truth: str, prompt: str) -> list[int]:
        """`chosen` with its answer swapped for a wrong one, the rest kept: only the answer differs."""
        at = 1 if chosen[0] in silent else 0
        while True:
            ids = [*chosen[:at], wrong_answer(truth, prompt), *chosen[at + 1 :]]
            ids = ids[: ids.index(eos) + 1] if eos in ids else ids
            if verified(ids, truth, 0.0):
                return ids

    pairs = []
    for row in make_digits_rows(num, seed):
        prompt = prompt_ids(tokenizer, row["prompt"])
        truth, digits = row["reward_model"]["ground_truth"], row["extra_info"]["digits"]
        kind = rng.random()
        if kind < TIE_PAIRS:  # two wrong answers, a third of the time two right ones
            right = rng.random() < 1 / 3
            first, second, wins = response(truth, digits, right), response(truth, digits, right), 0.5
        else:
            first, wins = response(truth, digits, True), 1.0
            swap = kind < TIE_PAIRS + (1 - TIE_PAIRS) / 2
            second = swapped(first, truth, digits) if swap else response(truth, digits, False)
        pairs.append((prompt + first, prompt + second, wins))
    return pairs


def read_pairs(path: str | Path, tokenizer) -> list[Pair]:
    """Pairs from a JSONL file (module doc); a bad line is named with its number."""
    pairs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            chosen, rejected = str(row["chosen"]), str(row["rejected"])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f'{path}:{number}: not a pair ({type(err).__name__}: {err}); each line is {{"prompt": text or '
                'chat messages, "chosen": text, "rejected": text}'
            ) from None
        pairs.append((chat_ids(tokenizer, messages, chosen), chat_ids(tokenizer, messages, rejected), 1.0))
    if not pairs:
        raise ValueError(f"{path}: no preference pairs")
    return pairs
