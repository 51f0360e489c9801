"""Chat transcripts for supervised fine-tuning: read, check, tokenize, mask, batch.

A row (parquet or jsonl) holds a list of messages under `messages` (sft.messages_key):

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...]}

Other keys of a message (a template's `name`, `tool_calls`) pass through to the chat template,
and a row's optional `tools` (a list of function schemas) goes to it as `tools=`, as
apply_chat_template takes them (a tool-calling model's template renders them into its prompt).
The conversation is rendered by the model's chat template and tokenized once; the loss covers
exactly the assistant turns: each turn's content and its end-of-turn token, never the system,
user or tool tokens nor the template's assistant header. Where a turn starts and ends is found
by rendering the conversation's prefixes, not by knowing the template:

    head  = render(messages[:i], add_generation_prompt=True)   what precedes turn i's content
    turn  = render(messages[:i+1])                             ... and the turn, with its end
    span  = [len(head), end of the first EOS token after the content, else len(turn))

Both prefixes must be prefixes of the whole rendering (a template that renders an earlier turn
differently once later turns follow is refused, naming the row). The spans are in characters;
the tokenizer's offsets put them on tokens, so a merge across a boundary cannot shift them.

Rows become the engine's layout (engine.py): the first trained token ends the "prompt", the rest
of the row is the "response" with `response_mask` = the loss mask (0 on user and tool turns in
between, as an agent trajectory's tool tokens are).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megarl.data.batch import Batch
from megarl.data.dataset import PromptBatches, read_rows
from megarl.data.errors import DatasetError

ROLES = ("system", "user", "assistant", "tool")
OVERLONG = ("error", "truncate")


def check_chat_tokenizer(tokenizer, model: str) -> None:
    """The tokenizer can render and mask conversations; DatasetError naming `model` otherwise."""
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            f"{model}: the tokenizer has no chat template, so chat rows cannot be rendered; start "
            "from a chat/instruct checkpoint or add a chat_template to its tokenizer_config.json"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DatasetError(
            f"{model}: the tokenizer is a slow (Python) one without token offsets, which the "
            "assistant-token mask needs; give the checkpoint a tokenizer.json (a fast tokenizer)"
        )


def check_chat_row(row, where: str, key: str = "messages") -> list[dict]:
    """The row's messages, checked; DatasetError naming the row and the field otherwise."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a mapping, got {type(row).__name__}")
    messages = row.get(key)
    if messages is None:
        raise DatasetError(f"{where}: missing field {key!r} (a list of {{role, content}} messages)")
    if isinstance(messages, np.ndarray):
        messages = list(messages)
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if isinstance(messages, list) else f"a {type(messages).__name__}"
        raise DatasetError(f"{where}: field {key!r} is {what}, expected a list of {{role, content}} messages")
    out = []
    for j, message in enumerate(messages):
        field = f"{key}[{j}]"
        if not isinstance(message, dict):
            raise DatasetError(f"{where}: field {field!r} is a {type(message).__name__}, expected {{role, content}}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DatasetError(f"{where}: field '{field}.role' is {role!r}, expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DatasetError(f"{where}: field '{field}.content' is a {type(content).__name__}, expected str")
        out.append({k: v for k, v in message.items() if v is not None})  # parquet fills absent keys with null
    if not any(m["role"] == "assistant" for m in out):
        raise DatasetError(f"{where}: field {key!r} has no assistant turn, so nothing to train on")
    return out


def check_tools(row: dict, where: str) -> list[dict] | None:
    """The row's `tools` (function schemas for the template), or None when it has none."""
    tools = row.get("tools")
    if tools is None:
        return None
    if isinstance(tools, np.ndarray):
        tools = list(tools)
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DatasetError(f"{where}: field 'tools' must be a list of function schemas (mappings)")
    return tools


def _render(tokenizer, messages: list[dict], generation: bool, where: str, tools: list[dict] | None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)
    except Exception as err:  # noqa: BLE001  (any template failure is the row's: named and re-raised)
        raise DatasetError(f"{where}: the chat template failed on the first {len(messages)} messages: {err}") from None


def assistant_spans(
    tokenizer, messages: list[dict], where: str = "<row>", tools: list[dict] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span [start, end) of every assistant turn's
    content and end of turn (see the module docstring)."""
    text = _render(tokenizer, messages, False, where, tools)
    eos = tokenizer.eos_token
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = _render(tokenizer, messages[:i], True, where, tools)
        turn = _render(tokenizer, messages[: i + 1], False, where, tools)
        if not (text.startswith(turn) and turn.startswith(head)):
            raise DatasetError(
                f"{where}: the chat template renders messages[:{i}] differently once later messages "
                f"follow, so assistant turn {i} cannot be located; check the row's roles and order"
            )
        start, end = len(head), len(turn)
        content_at = text.find(message["content"], start, end)
        after = start if content_at < 0 else content_at + len(message["content"])
        eos_at = text.find(eos, after, end) if eos else -1
        spans.append((start, eos_at + len(eos) if eos_at >= 0 else end))
    return text, spans


def tokenize_chat(
    tokenizer, messages: list[dict], where: str = "<row>", tools: list[dict] | None = None
) -> tuple[list[int], list[bool]]:
    """Token ids of the templated conversation (what apply_chat_template(tokenize=True) gives) and
    the loss mask: True on the tokens of the assistant spans. A token counts when it overlaps a
    span (or, empty, sits in one); the first token is never trained (nothing predicts it)."""
    text, spans = assistant_spans(tokenizer, messages, where, tools)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        mask |= (starts < b) & ((ends > a) | (starts >= a))
    mask[:1] = False
    return [int(i) for i in enc["input_ids"]], mask.tolist()


@dataclass
class SFTCounts:
    """What max_length did to a dataset's rows."""

    truncated: int = 0  # cut to max_length (overlong=truncate)
    dropped: int = 0  # no assistant token left within max_length, so not trained on


class SFTDataset:
    """Tokenized, masked conversations; example i is (ids, loss mask) as lists."""

    def __init__(self, rows: list, tokenizer, max_length: int, overlong="error", key="messages", source="<rows>"):
        if overlong not in OVERLONG:
            raise DatasetError(f"overlong={overlong!r} must be one of {OVERLONG}")
        self.source = source
        self.examples: list[tuple[list[int], list[bool]]] = []
        self.counts = SFTCounts()
        for index, raw in enumerate(rows):
            where = f"{source} row {index}"
            messages = check_chat_row(raw, where, key)
            ids, mask = tokenize_chat(tokenizer, messages, where, check_tools(raw, where))
            if not any(mask):
                raise DatasetError(f"{where}: field {key!r}: its assistant turns render to no token to train on")
            if len(ids) > max_length:
                if overlong == "error":
                    raise DatasetError(
                        f"{where}: the conversation is {len(ids)} tokens after the chat template, longer than "
                        f"sft.max_length={max_length}; raise it, shorten the row or set sft.overlong=truncate"
                    )
                ids, mask = ids[:max_length], mask[:max_length]
                self.counts.truncated += 1
                if not any(mask):
                    self.counts.dropped += 1
                    continue
            self.examples.append((ids, mask))
        if not self.examples:
            raise DatasetError(f"{source} has no conversation to train on")

    @classmethod
    def from_files(cls, paths: list[str], tokenizer, max_length: int, overlong="error", key="messages"):
        """One dataset of every file's rows, in order."""
        parts = [cls(read_rows(p), tokenizer, max_length, overlong, key, str(p)) for p in paths]
        out = parts[0]
        for part in parts[1:]:
            out.examples += part.examples
            out.counts.truncated += part.counts.truncated
            out.counts.dropped += part.counts.dropped
        out.source = "+".join(Path(p).name for p in paths) if len(paths) > 1 else str(paths[0])
        return out

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> tuple[list[int], list[bool]]:
        return self.examples[index]

    def tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.examples)


def engine_rows(examples: list[tuple[list[int], list[bool]]], meta: dict | None = None) -> Batch:
    """The engine's row layout (engine.py) of `examples`: the tokens before the first trained one
    are the prompt, the rest the response, response_mask the loss mask; right-padded with 0."""
    firsts = [mask.index(True) for _, mask in examples]
    T = max(len(ids) for ids, _ in examples)
    R = max(len(ids) - first for (ids, _), first in zip(examples, firsts))
    input_ids = torch.zeros(len(examples), T, dtype=torch.long)
    responses = torch.zeros(len(examples), R, dtype=torch.long)
    response_mask = torch.zeros(len(examples), R, dtype=torch.float32)
    for i, ((ids, mask), first) in enumerate(zip(examples, firsts)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        responses[i, : len(ids) - first] = torch.tensor(ids[first:])
        response_mask[i, : len(ids) - first] = torch.tensor(mask[first:], dtype=torch.float32)
    return Batch(
        {
            "input_ids": input_ids,
            "prompt_lengths": torch.tensor(firsts, dtype=torch.long),
            "responses": responses,
            "response_mask": response_mask,
        },
        meta=meta,
    )


class SFTBatches(PromptBatches):
    """Epoch-shuffled batches of engine rows, addressable by step (PromptBatches' order), so a
    resumed run continues with the batch the stopped one would have taken next."""

    def _make_batch(self, indices: list[int], epoch: int, step: int) -> Batch:
        return engine_rows([self.dataset[i] for i in indices], {"epoch": epoch, "step": step})


def eval_batches(dataset: SFTDataset, batch_size: int, multiple: int) -> list[Batch]:
    """The whole dataset in order, in batches of at most `batch_size` rows, each a multiple of
    `multiple` rows (the data-parallel size): the last is topped up with rows that count no token."""
    out = []
    for start in range(0, len(dataset), batch_size):
        examples = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        filler = -len(examples) % multiple
        batch = engine_rows(examples + [examples[0]] * filler)
        if filler:
            batch["response_mask"][len(examples) :] = 0
        out.append(batch)
    return out
