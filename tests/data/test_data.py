"""Procedural task generation, dataset validation/tokenization, deterministic batching."""

import json

import numpy as np
import pytest
import torch

from megarl.config import load_config
from megarl.data.batch import Batch
from megarl.data.build import build_datasets
from megarl.data.dataset import DatasetError, PromptBatches, RLDataset, read_rows, validate_row
from megarl.data.tasks import (
    ARITH_DATA_SOURCE,
    DIGITS_DATA_SOURCE,
    TASKS,
    digits_answer,
    generate_task,
    make_arith_rows,
    make_digits_rows,
    write_rows,
    write_task,
)
from megarl.models.tiny import build_tokenizer
from megarl.reward import score

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def good_row(content="382", answer="2"):
    return {
        "prompt": [{"role": "user", "content": content}],
        "data_source": DIGITS_DATA_SOURCE,
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": 0},
    }


# ------------------------------------------------------------------ task
def test_digits_rows_are_canonical_deterministic_and_prompt_dependent():
    rows = make_digits_rows(200, seed=3)
    assert rows == make_digits_rows(200, seed=3)
    assert rows != make_digits_rows(200, seed=4)
    for i, row in enumerate(rows):
        validate_row(row, f"row {i}")
        digits = row["prompt"][0]["content"]
        assert len(digits) == 3 and digits.isdigit()
        assert row["reward_model"]["ground_truth"] == digits[-1] == digits_answer(digits)
        assert row["data_source"] == DIGITS_DATA_SOURCE
    # the answer depends on the prompt: every digit occurs, no single answer dominates
    answers = [r["reward_model"]["ground_truth"] for r in rows]
    assert set(answers) == set("0123456789")
    assert max(answers.count(d) for d in set(answers)) < 0.2 * len(rows)


def test_digits_answers_score_through_the_reward_registry():
    row = make_digits_rows(1, seed=0)[0]
    truth = row["reward_model"]["ground_truth"]
    wrong = str((int(truth) + 1) % 10)
    assert score(row["data_source"], truth, truth) == 1.0
    assert score(row["data_source"], wrong, truth) == 0.0


def test_arith_rows_are_deterministic_and_score_through_the_registry():
    rows = make_arith_rows(100, seed=3)
    assert rows == make_arith_rows(100, seed=3) and rows != make_arith_rows(100, seed=4)
    assert {r["extra_info"]["op"] for r in rows} == {"+", "-"}
    for row in rows:
        info, truth = row["extra_info"], row["reward_model"]["ground_truth"]
        assert row["data_source"] == ARITH_DATA_SOURCE
        assert row["prompt"][0]["content"].startswith(f"What is {info['a']} {info['op']} {info['b']}? ")
        assert int(truth) == (info["a"] + info["b"] if info["op"] == "+" else info["a"] - info["b"])
        assert score(row["data_source"], f"The answer is {truth}.", truth) == 1.0
        assert score(row["data_source"], f"{truth} plus one is {int(truth) + 1}", truth) == 0.0


def test_config_accepts_the_tasks_and_names_a_bad_one():
    from megarl.config import ConfigError, validate

    for task in [*TASKS, "rg:basic_arithmetic", "rg:countdown"]:
        validate(load_config(None, [f"data.task={task}"]))
    with pytest.raises(ConfigError, match=r"data\.task='nope' must be digits, arith, arith_tool, add20, shapes or rg:"):
        validate(load_config(None, ["data.task=nope"]))
    with pytest.raises(ConfigError, match=r"data\.task='rg:nope': reasoning-gym has no dataset 'nope'"):
        validate(load_config(None, ["data.task=rg:nope"]))


def test_unknown_task_is_named():
    with pytest.raises(
        ValueError,
        match=r"unknown procedural task 'nope'; known tasks: \['add20', 'arith', 'arith_tool', 'digits', 'shapes'\]",
    ):
        generate_task("nope", 3)


def test_add20_validation_sums_are_held_out_of_training():
    train = generate_task("add20", 5000, seed=0)
    val = generate_task("add20", 64, seed=1, split="val")
    pairs = {
        split: {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows}
        for split, rows in (("t", train), ("v", val))
    }
    assert not pairs["t"] & pairs["v"]
    assert len(pairs["v"]) == 64  # 89 held out: no question twice
    assert len(pairs["t"]) == 441 - 89  # 5000 draws reach every training sum
    for row in val:
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert row["reward_model"]["ground_truth"] == str(a + b)
        assert row["prompt"][0]["content"] == f"What is {a} + {b}? Answer with the number only."


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_write_and_read_roundtrip(tmp_path, suffix):
    rows = make_digits_rows(17, seed=1)
    path = write_rows(rows, tmp_path / f"train{suffix}")
    assert read_rows(path) == rows


def test_write_task_is_parquet_with_canonical_schema(tmp_path):
    import pyarrow.parquet as pq

    path = write_task("digits", 8, 0, tmp_path / "d.parquet")
    schema = pq.read_schema(path)
    assert set(schema.names) == {"prompt", "data_source", "reward_model", "extra_info"}
    with pytest.raises(ValueError, match="use a .parquet or .jsonl"):
        write_rows([good_row()], tmp_path / "x.csv")


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.pop("prompt"), "missing field 'prompt'"),
        (lambda r: r.update(prompt="382"), "field 'prompt' is a str, expected list/ndarray"),
        (lambda r: r.update(prompt=[]), "field 'prompt' has no messages"),
        (lambda r: r["prompt"][0].pop("role"), "prompt[0]: missing field 'role'"),
        (lambda r: r["prompt"][0].update(content=5), "prompt[0]: field 'content' is a int"),
        (lambda r: r.pop("data_source"), "missing field 'data_source'"),
        (lambda r: r["reward_model"].pop("ground_truth"), "missing field 'reward_model.ground_truth'"),
        (lambda r: r["reward_model"].update(ground_truth=2), "'reward_model.ground_truth' is a int"),
        (lambda r: r["reward_model"].update(style="human"), "'reward_model.style' is 'human'"),
        (lambda r: r.pop("reward_model"), "missing field 'reward_model.ground_truth'"),
        (lambda r: r.pop("extra_info"), "missing field 'extra_info'"),
        (lambda r: r.update(extra_info=[1]), "field 'extra_info' is a list, expected dict"),
    ],
)
def test_bad_rows_name_file_row_and_field(tmp_path, tokenizer, mutate, message):
    rows = make_digits_rows(20, seed=0)
    mutate(rows[17])
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError) as info:
        RLDataset.from_file(path, tokenizer, max_prompt_length=16)
    assert str(info.value).startswith("train.jsonl row 17: ")
    assert message in str(info.value)


def test_parquet_missing_field_message(tmp_path, tokenizer):
    rows = make_digits_rows(20, seed=0)
    rows[17]["reward_model"]["ground_truth"] = None  # parquet stores a missing value as null
    path = write_rows(rows, tmp_path / "train.parquet")
    with pytest.raises(
        DatasetError,
        match=r"^train\.parquet row 17: missing field "
        r"'reward_model\.ground_truth'$",
    ):
        RLDataset.from_file(path, tokenizer, max_prompt_length=16)


def test_null_extra_info_reads_as_empty_dict(tokenizer):
    row = good_row()
    row["extra_info"] = None
    assert RLDataset([row], tokenizer, 16)[0]["extra_info"] == {}


def test_file_level_errors(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match="does not exist"):
        read_rows(tmp_path / "none.parquet")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(good_row()) + "\n{not json\n")
    with pytest.raises(DatasetError, match="bad.jsonl line 2: not valid JSON"):
        read_rows(bad)
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(DatasetError, match="must be .parquet or .jsonl"):
        read_rows(tmp_path / "x.txt")
    with pytest.raises(DatasetError, match="has no rows"):
        RLDataset([], tokenizer, 16)


# ------------------------------------------------------------------ tokenization
def test_prompts_tokenized_with_chat_template(tokenizer):
    ds = RLDataset([good_row("382")], tokenizer, max_prompt_length=16, source="mem")
    ids = ds[0]["raw_prompt_ids"]
    text = tokenizer.decode(ids)
    assert text == "<|user|>382<|assistant|>"
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert len(ids) == 5


def test_too_long_prompt_is_rejected_with_its_row(tokenizer):
    rows = [good_row("1"), good_row("1234567890123")]
    with pytest.raises(
        DatasetError,
        match=r"mem row 1: prompt is 15 tokens, longer than "
        r"data\.max_prompt_length=14",
    ):
        RLDataset(rows, tokenizer, max_prompt_length=14, source="mem")
    assert len(RLDataset(rows, tokenizer, max_prompt_length=15)) == 2


def test_too_long_prompts_filtered_are_counted_and_reported(tokenizer, caplog):
    rows = [good_row("1"), good_row("1234567890123"), good_row("2")]
    with caplog.at_level("WARNING", logger="megarl.data.dataset"):
        data = RLDataset(rows, tokenizer, max_prompt_length=14, source="mem", overlong="filter")
    assert len(data) == 2 and data.num_filtered == 1
    assert [r["prompt"][0]["content"] for r in data.rows] == ["1", "2"]
    assert "mem: dropped 1 of 3 prompts longer than data.max_prompt_length=14: row 1 (15 tokens)" in caplog.text
    with pytest.raises(DatasetError, match=r"mem has no rows \(all 1 were longer"):
        RLDataset(rows[1:2], tokenizer, max_prompt_length=14, source="mem", overlong="filter")


def test_custom_prompt_key(tokenizer):
    row = good_row()
    row["messages"] = row.pop("prompt")
    ds = RLDataset([row], tokenizer, 16, prompt_key="messages")
    assert len(ds[0]["raw_prompt_ids"]) == 5


# ------------------------------------------------------------------ batching
@pytest.fixture(scope="module")
def dataset(tokenizer):
    return RLDataset(make_digits_rows(10, seed=0), tokenizer, 16, source="mem")


def test_batches_have_the_contract_columns(dataset):
    batch = PromptBatches(dataset, batch_size=4, seed=0).batch_at(0)
    assert isinstance(batch, Batch) and len(batch) == 4
    for key in ("raw_prompt_ids", "data_source", "ground_truth", "extra_info", "uid"):
        assert batch[key].dtype == object and len(batch[key]) == 4
    assert all(isinstance(ids, list) and all(isinstance(t, int) for t in ids) for ids in batch["raw_prompt_ids"])
    # each row's fields come from the same dataset row
    for ids, truth, extra in zip(batch["raw_prompt_ids"], batch["ground_truth"], batch["extra_info"]):
        assert extra["digits"][-1] == truth
        assert dataset.rows[extra["index"]]["raw_prompt_ids"] == ids
    assert batch.meta == {"epoch": 0, "step": 0}


def test_epoch_shuffle_is_deterministic_and_covers_every_row(dataset):
    loader = PromptBatches(dataset, batch_size=3, shuffle=True, seed=7)
    assert loader.steps_per_epoch == 3  # 10 rows, drop_last
    epoch0 = [list(b["uid"]) for b in loader.epoch(0)]
    again = [list(b["uid"]) for b in PromptBatches(dataset, 3, True, seed=7).epoch(0)]
    assert epoch0 == again
    seen = [u for uids in epoch0 for u in uids]
    assert len(set(seen)) == 9 and all(u.startswith("e0-") for u in seen)
    epoch1 = [list(b["uid"]) for b in loader.epoch(1)]
    assert [u.split("-")[1] for b in epoch1 for u in b] != [u.split("-")[1] for u in seen]
    other_seed = [list(b["uid"]) for b in PromptBatches(dataset, 3, True, seed=8).epoch(0)]
    assert other_seed != epoch0


def test_resume_from_step_equals_uninterrupted_run(dataset):
    loader = PromptBatches(dataset, batch_size=4, seed=1)
    full = [list(b["uid"]) for b in loader.iterate(0, 7)]
    resumed = [list(b["uid"]) for b in loader.iterate(4, 3)]
    assert resumed == full[4:]
    # uids never repeat across steps: the same row in a later epoch is a new prompt group
    flat = [u for uids in full for u in uids]
    assert len(set(flat)) == len(flat)


def test_unshuffled_keep_last_for_validation(dataset):
    loader = PromptBatches(dataset, batch_size=4, shuffle=False, drop_last=False)
    sizes = [len(b) for b in loader.epoch(0)]
    assert sizes == [4, 4, 2]
    assert [e["index"] for b in loader.epoch(0) for e in b["extra_info"]] == list(range(10))


def test_batch_larger_than_dataset_is_named(dataset):
    with pytest.raises(DatasetError, match="fewer than one batch of 64"):
        PromptBatches(dataset, batch_size=64)


def test_repeat_interleave_keeps_prompt_groups(dataset):
    batch = PromptBatches(dataset, batch_size=2).batch_at(0).repeat_interleave(3)
    uids = list(batch["uid"])
    assert uids[0] == uids[1] == uids[2] != uids[3]


def test_build_datasets_from_config(tmp_path, tokenizer):
    cfg = load_config(None, ["data.num_train=40", "data.num_val=8"])
    train, val = build_datasets(cfg.data, tokenizer, tmp_path)
    assert len(train) == 40 and len(val) == 8
    assert (tmp_path / "digits_train.parquet").is_file()
    train_prompts = [r["prompt"] for r in train.rows[:8]]
    assert train_prompts != [r["prompt"] for r in val.rows]  # different seed
    cfg = load_config(None, [f"data.train_files={tmp_path / 'digits_val.parquet'}", "data.num_val=0"])
    train, val = build_datasets(cfg.data, tokenizer, tmp_path / "other")
    assert len(train) == 8 and val is None
    assert np.all([r["data_source"] == DIGITS_DATA_SOURCE for r in train.rows])


# ------------------------------------------------------------------ reasoning-gym tasks
RG_TASKS = ["basic_arithmetic", "chain_sum", "countdown"]


@pytest.mark.parametrize("name", RG_TASKS)
def test_reasoning_gym_rows_are_deterministic_by_seed(name):
    rows = generate_task(f"rg:{name}", 6, seed=3)
    assert rows == generate_task(f"rg:{name}", 6, seed=3)
    assert [r["prompt"] for r in rows] != [r["prompt"] for r in generate_task(f"rg:{name}", 6, seed=4)]
    for index, row in enumerate(rows):
        validate_row(row, "rg")
        assert row["data_source"] == f"reasoning_gym/{name}" and row["extra_info"]["index"] == index
        assert json.loads(row["extra_info"]["rg_entry"])["question"] == row["prompt"][0]["content"]


@pytest.mark.parametrize("name", RG_TASKS)
def test_reasoning_gym_scorer_round_trip_through_a_file(tmp_path, name):
    write_task(f"rg:{name}", 8, 0, tmp_path / "rg.parquet")
    for row in read_rows(tmp_path / "rg.parquet"):  # the entry survives parquet
        truth, extra = row["reward_model"]["ground_truth"], row["extra_info"]
        assert score(row["data_source"], truth, truth, extra) == 1.0
        assert score(row["data_source"], f"Let me think.\n<answer>{truth}</answer>", truth, extra) == 1.0
        assert score(row["data_source"], "<answer>none</answer>", truth, extra) < 0.1  # wrong


def test_reasoning_gym_entry_keeps_tuples_and_sets():
    from megarl.data.reasoning_gym_task import decode_entry, encode_entry

    entry = {"answer": "x", "metadata": {"board": ((1, 2), (3, 4)), "seen": {5}, "list": [(6,)]}}
    assert decode_entry(encode_entry(entry)) == entry


def test_reasoning_gym_errors_are_named():
    from megarl.reward import RewardError

    with pytest.raises(ValueError, match="reasoning-gym has no dataset 'nope'"):
        generate_task("rg:nope", 2)
    with pytest.raises(RewardError, match="reasoning-gym has no dataset 'nope'"):
        score("reasoning_gym/nope", "1", "1", {})
    with pytest.raises(RewardError, match=r"needs extra_info\['rg_entry'\]"):
        score("reasoning_gym/chain_sum", "1", "1", {})


def test_build_datasets_with_a_reasoning_gym_task(tmp_path, tokenizer):
    cfg = load_config(
        None, ["data.task=rg:chain_sum", "data.num_train=12", "data.num_val=4", "data.max_prompt_length=512"]
    )
    train, val = build_datasets(cfg.data, tokenizer, tmp_path)
    assert (len(train), len(val)) == (12, 4) and (tmp_path / "rg_chain_sum_train.parquet").is_file()
    assert {r["data_source"] for r in train.rows} == {"reasoning_gym/chain_sum"}
