"""Chat rows for SFT (megarl/data/sft.py): the loss mask covers exactly the assistant tokens, bad
rows are named by file, row and field, and rows become the engine's layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megarl.data.errors import DatasetError
from megarl.data.sft import (
    SFTBatches,
    SFTDataset,
    check_chat_row,
    check_chat_tokenizer,
    engine_rows,
    eval_batches,
    tokenize_chat,
)

ROOT = Path(__file__).resolve().parents[2]
CHAT = [
    {"role": "system", "content": "be kind."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "tool", "content": "4\n"},
    {"role": "assistant", "content": "ok"},
]


@pytest.fixture(scope="module")
def tools_tok():
    from megarl.models.tiny import build_tokenizer

    return build_tokenizer(tools=True)


def masked_runs(tok, ids, mask) -> list[str]:
    """The decoded text of every run of consecutive masked tokens."""
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs + ([tok.decode(current)] if current else [])


def test_the_mask_covers_exactly_the_assistant_tokens_hand_checked(tools_tok):
    """tiny-qwen3-moe-tools renders
        <|system|>be kind.<|user|>hi<|assistant|>yo<eos><|user|><tool_response>4\\n</tool_response><|assistant|>ok<eos>
    one token per character or marker: tokens 13-15 ("yo<eos>") and 22-24 ("ok<eos>") are the
    assistant's, each turn's content and the end-of-turn token the template writes after it."""
    ids, mask = tokenize_chat(tools_tok, CHAT)
    tokens = [tools_tok.convert_ids_to_tokens(i) for i in ids]
    assert tokens[:3] == ["<|system|>", "b", "e"] and tokens[12:17] == ["<|assistant|>", "y", "o", "<eos>", "<|user|>"]
    assert tokens[17:25] == ["<tool_response>", "4", "\n", "</tool_response>", "<|assistant|>", "o", "k", "<eos>"]
    assert [i for i, m in enumerate(mask) if m] == [13, 14, 15, 22, 23, 24]
    assert ids == list(tools_tok.apply_chat_template(CHAT, tokenize=True))  # the template's own tokens


@pytest.mark.slow  # materialises SmolLM2 from its GGUF when ~/.cache/megarl holds no copy yet
def test_smollm2_mask_is_the_assistant_content_and_its_end_of_turn_token():
    """SmolLM2's template adds a default system message, `<|im_start|>assistant\\n` headers and
    `<|im_end|>\\n` after every turn: the mask holds each reply and its <|im_end|> (the token that
    ends generation), not the header nor the newline after it."""
    from transformers import AutoTokenizer

    from megarl.models.smollm2 import materialize

    tok = AutoTokenizer.from_pretrained(materialize())
    chat = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!\n\nHow can I help?"},
        {"role": "user", "content": "Bye"},
        {"role": "tool", "content": "logged"},
        {"role": "assistant", "content": " Bye now."},
    ]
    ids, mask = tokenize_chat(tok, chat)
    assert ids == list(tok.apply_chat_template(chat, tokenize=True))
    assert masked_runs(tok, ids, mask) == ["Hello!\n\nHow can I help?<|im_end|>", " Bye now.<|im_end|>"]
    assert sum(mask) == len(tok("Hello!\n\nHow can I help? Bye now.", add_special_tokens=False).input_ids) + 2


def test_engine_rows_start_the_response_at_the_first_trained_token(tools_tok):
    first, second = tokenize_chat(tools_tok, CHAT), tokenize_chat(tools_tok, CHAT[1:3])
    rows = engine_rows([first, second])
    assert rows["prompt_lengths"].tolist() == [13, 4]  # <|user|>hi<|assistant|> precede the second's "yo"
    ids, mask = first
    assert rows["responses"][0].tolist() == ids[13:]
    assert rows["response_mask"][0].tolist() == [float(m) for m in mask[13:]]
    assert rows["input_ids"][1, :7].tolist() == second[0] and rows["response_mask"][1].sum() == 3
    from megarl.engine.megatron.packing import row_lengths

    assert row_lengths(rows["input_ids"], rows["prompt_lengths"], rows["response_mask"]).tolist() == [25, 7]


@pytest.mark.parametrize(
    "row,field",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "field 'messages' has no assistant turn"),
        ({"messages": "hi"}, "field 'messages' is a str"),
        ({"messages": []}, "field 'messages' is an empty list"),
        ({"conversation": []}, "missing field 'messages'"),
        ({"messages": [{"role": "user", "content": "hi"}, "yo"]}, "field 'messages[1]' is a str"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "field 'messages[0].role' is 'bot'"),
        ({"messages": [{"role": "assistant", "content": 3}]}, "field 'messages[0].content' is a int"),
        (
            {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
            "field 'messages[0].content' is a NoneType",
        ),
    ],
)
def test_a_bad_row_is_named_by_file_row_and_field(tmp_path, tools_tok, row, field):
    path = tmp_path / "chats.jsonl"
    good = {"messages": CHAT}
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, good, row)))
    with pytest.raises(DatasetError) as err:
        SFTDataset.from_files([str(path)], tools_tok, 64)
    assert str(err.value).startswith(f"{path} row 2: {field}"), str(err.value)


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_row(tools_tok):
    """Prefix renderings must be prefixes of the whole: this template numbers the messages first."""
    from megarl.models.tiny import build_tokenizer

    tok = build_tokenizer(tools=True)
    tok.chat_template = "{{ messages|length }}" + tools_tok.chat_template
    with pytest.raises(DatasetError, match=r"x row 0: the chat template renders messages\[:1\] differently"):
        SFTDataset([{"messages": CHAT[1:3]}], tok, 64, source="x")


def test_a_rows_tools_reach_the_template_and_stay_out_of_the_loss(tools_tok):
    """A row's `tools` (function schemas) go to the template as apply_chat_template's tools=."""
    from megarl.models.tiny import build_tokenizer

    tok = build_tokenizer(tools=True)
    tok.chat_template = (
        "{% if tools %}<|system|>tools: {% for t in tools %}{{ t['function']['name'] }}{% endfor %}{% endif %}"
        + tools_tok.chat_template
    )
    tools = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]
    data = SFTDataset([{"messages": CHAT[1:3], "tools": tools}], tok, 64)
    ids, mask = data[0]
    assert tok.decode(ids).startswith("<|system|>tools: python<|user|>hi")
    assert masked_runs(tok, ids, mask) == ["yo<eos>"]
    with pytest.raises(DatasetError, match="x row 0: field 'tools' must be a list of function schemas"):
        SFTDataset([{"messages": CHAT[1:3], "tools": "python"}], tok, 64, source="x")


def test_a_tokenizer_without_a_chat_template_is_refused(tools_tok):
    from megarl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = None
    with pytest.raises(DatasetError, match="model.path=/m: the tokenizer has no chat template"):
        check_chat_tokenizer(tok, "model.path=/m")
    check_chat_tokenizer(tools_tok, "model.preset=tiny-qwen3-moe-tools")


def test_max_length_refuses_or_cuts_and_counts(tools_tok):
    long_chat = [{"role": "user", "content": "a" * 30}, {"role": "assistant", "content": "b" * 10}]
    rows = [{"messages": CHAT}, {"messages": long_chat}, {"messages": long_chat[:1] + [CHAT[2]]}]
    with pytest.raises(DatasetError, match=r"row 1: the conversation is 43 tokens .* sft.max_length=30"):
        SFTDataset(rows, tools_tok, 30)
    cut = SFTDataset(rows, tools_tok, 30, overlong="truncate")
    # row 1 (43 tokens) keeps no "b" within 30 (dropped); row 2 (35) keeps none of its "yo" either
    assert (cut.counts.truncated, cut.counts.dropped, len(cut)) == (2, 2, 1)
    cut = SFTDataset(rows, tools_tok, 35, overlong="truncate")  # row 1 keeps 3 "b"s, row 2 fits
    assert (cut.counts.truncated, cut.counts.dropped, len(cut)) == (1, 0, 3)
    assert len(cut[1][0]) == 35 and sum(cut[1][1]) == 3


def test_batches_follow_the_epoch_order_and_eval_batches_pad_with_untrained_rows(tools_tok):
    rows = [{"messages": CHAT[1:2] + [{"role": "assistant", "content": "x" * (k + 1)}]} for k in range(10)]
    data = SFTDataset(rows, tools_tok, 64)
    batches = SFTBatches(data, 4, shuffle=True, seed=3)
    assert batches.steps_per_epoch == 2
    seen = [int(m.sum()) - 2 for step in range(2) for m in batches.batch_at(step)["response_mask"]]  # x..x<eos>
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 8  # distinct rows of one epoch
    assert torch.equal(batches.batch_at(5)["input_ids"], SFTBatches(data, 4, True, 3).batch_at(5)["input_ids"])
    evals = eval_batches(data, 4, multiple=3)
    assert [len(b) for b in evals] == [6, 6, 3] and evals[-1].meta == {}
    assert sum(float(b["response_mask"].sum()) for b in evals) == sum(k + 2 for k in range(10))


def test_the_shipped_example_data_is_arith_tool_transcripts_with_valid_calls():
    from megarl.data.tasks import make_arith_tool_chats
    from megarl.rollout.agent.tools import parse_tool_calls

    for name, num, seed in (("train", 32, 0), ("val", 8, 1)):
        path = ROOT / "configs" / "data" / f"sft-arith-tool-{name}.jsonl"
        assert [json.loads(x) for x in path.read_text().splitlines()] == make_arith_tool_chats(num, seed)
    row = make_arith_tool_chats(1)[0]["messages"]
    [call] = parse_tool_calls(row[1]["content"])
    assert call.name == "python" and call.error is None
    assert call.arguments["code"] == f"print({row[0]['content'].removeprefix('What is ').removesuffix('?')})"
    assert eval(call.arguments["code"][6:-1]) == int(row[3]["content"]) == int(row[2]["content"])  # noqa: S307


def test_check_chat_row_passes_other_message_keys_and_drops_nulls():
    messages = check_chat_row(
        {"messages": [{"role": "user", "content": "q", "name": None}, {"role": "assistant", "content": "a", "x": 1}]},
        "f row 0",
    )
    assert messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "x": 1}]
