"""Preference pairs for reward-model training: (chosen, rejected) token sequences, each a prompt
and a response as the reward model will score them.

`digits_pairs`: made in code from the digits task's ground truth (megarl/data/tasks.py). For each
prompt, a response the task's own verifier scores 1 is preferred over one it scores 0. Responses
are token ids drawn from the policy's whole vocabulary, the way the tiny policy samples them
(rollout.max_new_tokens tokens, cut after an end-of-sequence token), and labelled by the verifier
on their decoded text (special and unknown ids decode to nothing, so "<|user|>7" answers 7):
the reward model learns the rule on the responses it will be shown, not on tidy strings. The
sequence is the prompt's chat template with the generation prompt, then the response ids: the
token ids the policy saw, which the classifier reuses when it shares the policy's tokenizer.

`read_pairs`: a JSONL file of {"prompt": text or chat messages, "chosen": text, "rejected": text},
each conversation encoded with the reward model's tokenizer and chat template (classifier.chat_ids,
as the classifier encodes a policy's rows when the tokenizers differ).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from megarl.data.tasks import make_digits_rows
from megarl.reward.classifier import chat_ids
from megarl.reward.rule import digits_score

Pair = tuple[list[int], list[int]]  # (chosen, rejected) token ids


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

    def response(truth: str, prompt: str, correct: bool) -> list[int]:
        want = 1.0 if correct else 0.0
        while True:
            if correct:
                head = [digit[truth]]
            else:
                head = [
                    rng.choice([digit[d] for d in "0123456789" + prompt if d != truth] + [rng.randrange(vocab_size)])
                ]
            if max_response_tokens > 1 and rng.random() < 0.25:
                head = [rng.choice(silent), *head]  # the answer behind a token that decodes to nothing
            ids = sample(head)
            if digits_score(tokenizer.decode(ids, skip_special_tokens=True), truth, {}) == want:
                return ids

    pairs = []
    for row in make_digits_rows(num, seed):
        prompt = prompt_ids(tokenizer, row["prompt"])
        truth, digits = row["reward_model"]["ground_truth"], row["extra_info"]["digits"]
        pairs.append((prompt + response(truth, digits, True), prompt + response(truth, digits, False)))
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
        pairs.append((chat_ids(tokenizer, messages, chosen), chat_ids(tokenizer, messages, rejected)))
    if not pairs:
        raise ValueError(f"{path}: no preference pairs")
    return pairs
