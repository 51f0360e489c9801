"""data.custom_cls, weighted mixing of train files, several val sets with pass@k / mean@k."""

from __future__ import annotations

import collections
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megarl.config import ConfigError, load_config, validate
from megarl.data.batch import Batch
from megarl.data.build import build_datasets
from megarl.data.dataset import DatasetError, PromptBatches, RLDataset
from megarl.data.mix import MixedDataset, MixedPromptBatches, data_mix_identity, make_prompt_batches
from megarl.data.tasks import ARITH_DATA_SOURCE, DIGITS_DATA_SOURCE, make_arith_rows, make_digits_rows, write_rows
from megarl.models.tiny import build_tokenizer
from megarl.trainer.validation import run_validation, validation_metrics

torch.set_num_threads(1)

ROWS_CLASS = '''
import csv

class CsvRows:
    """Rows from a csv of question,answer; with no file, `num_train` / `num_val` made-up ones."""
    def __init__(self, path, tokenizer, config, split):
        if path is None:
            n = config.num_train if split == "train" else config.num_val
            pairs = [(f"{split} {i}", str(i % 10)) for i in range(n)]
        else:
            with open(path) as f:
                pairs = [(r["question"], r["answer"]) for r in csv.DictReader(f)]
        self.rows = [{"prompt": [{"role": "user", "content": q}], "data_source": "csv/" + split,
                      "reward_model": {"ground_truth": a, "style": "rule"}, "extra_info": None}
                     for q, a in pairs]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

class Broken:
    def __init__(self, path, tokenizer, config, split):
        raise FileNotFoundError("no such table: " + str(path))

class NotRows:
    def __init__(self, path, tokenizer, config, split):
        pass

class MissingSource(CsvRows):
    def __getitem__(self, i):
        return {k: v for k, v in self.rows[i].items() if k != "data_source"}
'''


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def rows_py(tmp_path):
    path = tmp_path / "my_rows.py"
    path.write_text(ROWS_CLASS)
    csv = tmp_path / "qa.csv"
    csv.write_text("question,answer\n" + "".join(f"what is {i}?,{i}\n" for i in range(12)))
    return path, csv


def dataset(rows, tokenizer, source):
    return RLDataset(rows, tokenizer, 64, source=source)


# ------------------------------------------------------------------ data.custom_cls
def test_custom_cls_from_a_file_reads_each_file_and_makes_rows_without_one(tmp_path, tokenizer, rows_py):
    py, csv = rows_py
    # a .csv is fine with a class that reads it; refused without one
    cfg = validate(
        load_config(None, [f"data.custom_cls={py}:CsvRows", f"data.train_files=[{csv}, {csv}]", "data.num_val=5"])
    )
    train, val = build_datasets(cfg.data, tokenizer, tmp_path / "work")
    assert len(train) == 24 and train.rows[0]["prompt"][0]["content"] == "what is 0?"
    assert train.rows[0]["extra_info"] == {} and train.rows[0]["raw_prompt_ids"]  # validated, tokenized
    # no val_files: the class makes the val rows itself (path None, split "val", config.num_val)
    assert len(val) == 5 and {r["data_source"] for r in val.rows} == {"csv/val"}
    with pytest.raises(
        ConfigError,
        match=r"data\.train_files=.*qa\.csv' must end in \.parquet or "
        r"\.jsonl \(or set data\.custom_cls",
    ):
        validate(load_config(None, [f"data.train_files={csv}"]))


def test_custom_cls_from_a_module(tmp_path, tokenizer, monkeypatch):
    name = f"rows_mod_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(ROWS_CLASS)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = validate(load_config(None, [f"data.custom_cls={name}:CsvRows", "data.num_train=20", "data.num_val=0"]))
    train, val = build_datasets(cfg.data, tokenizer, tmp_path / "work")
    assert len(train) == 20 and train.rows[3]["prompt"][0]["content"] == "train 3" and val is None
    assert not (tmp_path / "work").exists()  # data.task was not generated


@pytest.mark.parametrize(
    "spec, message",
    [
        ("my_rows.py", r"data\.custom_cls='my_rows\.py' must look like 'path/to/file\.py:ClassName'"),
        ("nowhere.py:CsvRows", r"data\.custom_cls='nowhere\.py:CsvRows': file nowhere\.py does not exist"),
        ("not a module:X", r"must look like 'path/to/file\.py:ClassName' or 'package\.module:ClassName'"),
    ],
)
def test_custom_cls_bad_specs_are_refused_by_validate(spec, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, [f"data.custom_cls={spec}"]))


@pytest.mark.parametrize(
    "cls, message",
    [
        (
            "Nope",
            r"data\.custom_cls='.*my_rows\.py:Nope': '.*my_rows\.py' has no 'Nope' \(its classes: "
            r"Broken, CsvRows, MissingSource, NotRows\)",
        ),
        (
            "Broken",
            r"data\.custom_cls='.*:Broken': Broken\(None, tokenizer, config, split='train'\) raised "
            r"FileNotFoundError: no such table: None",
        ),
        (
            "NotRows",
            r"data\.custom_cls='.*:NotRows': NotRows\(.*\) gave a NotRows, which is not a sequence "
            r"of rows; the class must define __len__ and __getitem__",
        ),
        (
            "MissingSource",
            r"data\.custom_cls MissingSource\(train\) row 0: missing field 'data_source' "
            r"\(rows made by data\.custom_cls=",
        ),
    ],
)
def test_custom_cls_errors_name_the_key_the_call_and_the_row(tmp_path, tokenizer, rows_py, cls, message):
    py, _ = rows_py
    cfg = load_config(None, [f"data.custom_cls={py}:{cls}", "data.num_train=4"])
    with pytest.raises(DatasetError, match=message):
        build_datasets(cfg.data, tokenizer, tmp_path / "work")


def test_custom_cls_missing_module_is_named(tmp_path, tokenizer):
    cfg = load_config(None, ["data.custom_cls=no_such_pkg.rows:Rows"])
    with pytest.raises(
        DatasetError,
        match=r"data\.custom_cls='no_such_pkg\.rows:Rows': cannot import "
        r"'no_such_pkg\.rows' .*PYTHONPATH",
    ):
        build_datasets(cfg.data, tokenizer, tmp_path)


# ------------------------------------------------------------------ weighted mixing
@pytest.fixture(scope="module")
def mixed(tokenizer):
    parts = [
        dataset(make_digits_rows(10, seed=1), tokenizer, "small.parquet"),
        dataset(make_arith_rows(50, seed=2), tokenizer, "big.parquet"),
        dataset(make_digits_rows(7, seed=3), tokenizer, "tiny.parquet"),
    ]
    return MixedDataset(parts, [5.0, 3.0, 2.0], ["small", "big", "tiny"])


def source_of(uid: str) -> int:
    return int(uid.split("-")[0][1:])


def test_mix_fractions_follow_the_weights(mixed):
    """2000 batches of 16 (32000 draws): each file's share within 0.01 of its weight (the
    binomial standard error is at most sqrt(0.25/32000) = 0.0028, so 0.01 is > 3.5 sigma; the
    draws are seeded, so the check is deterministic)."""
    batches = MixedPromptBatches(mixed, 16, seed=7)
    counts = np.zeros(3)
    for step in range(2000):
        batch = batches.batch_at(step)
        sources = [source_of(u) for u in batch["uid"]]
        per_file = np.bincount(sources, minlength=3)
        counts += per_file
        # the logged fractions are this batch's own
        assert batch.meta["metrics"] == {
            f"data/source_frac/{n}": c / 16 for n, c in zip(mixed.names, per_file.tolist())
        }
    np.testing.assert_allclose(counts / counts.sum(), [0.5, 0.3, 0.2], atol=0.01)
    assert abs(counts.sum() - 32000) == 0


def test_each_file_is_used_once_per_epoch_before_it_repeats(mixed):
    batches = MixedPromptBatches(mixed, 16, seed=0)
    drawn = collections.defaultdict(list)  # file -> rows in the order they were drawn
    for step in range(60):
        for uid in batches.batch_at(step)["uid"]:
            source, epoch, row = uid[1:].split("-")
            drawn[int(source)].append((int(epoch[1:]), int(row[1:])))
    for source, part in enumerate(mixed.parts):
        seq = sorted(drawn[source])  # (epoch, row): within one epoch every row exactly once
        full_epochs = len(seq) // len(part)
        assert full_epochs >= 2, (source, len(seq))
        for e in range(full_epochs):
            assert sorted(r for ep, r in seq if ep == e) == list(range(len(part)))
        # the epochs' orders differ (shuffled per file and epoch)
        orders = [[r for ep, r in drawn[source] if ep == e] for e in range(2)]
        assert orders[0] != orders[1]


def test_mixed_batch_at_is_a_pure_function_of_the_step(mixed):
    def columns(b: Batch):
        return (list(b["uid"]), [list(p) for p in b["raw_prompt_ids"]], list(b["data_source"]))

    a = MixedPromptBatches(mixed, 8, seed=3)
    forward = [columns(b) for b in a.iterate(0, 40)]
    # a fresh object asked for step 25 first (a resume), then out of order, gives the same batches
    b = MixedPromptBatches(mixed, 8, seed=3)
    assert [columns(x) for x in b.iterate(25, 15)] == forward[25:]
    assert columns(b.batch_at(3)) == forward[3] and columns(b.batch_at(39)) == forward[39]
    other = [columns(x) for x in MixedPromptBatches(mixed, 8, seed=4).iterate(0, 40)]
    assert other != forward
    assert all(len(set(uids)) == len(uids) for uids, _, _ in forward)


def test_file_cursors_are_the_sum_of_earlier_counts_across_draw_blocks(mixed):
    """The cursors are cached over blocks of 1024 steps: asked in any order, they equal the
    running sum of each step's counts (a brute-force reference)."""
    reference = np.cumsum([MixedPromptBatches(mixed, 16, seed=1).counts_at(s) for s in range(2100)], 0)
    b = MixedPromptBatches(mixed, 16, seed=1)
    for step in (2100, 1, 1023, 1024, 1025, 2048, 700):
        assert b.taken_before(step).tolist() == reference[step - 1].tolist(), step
    fresh = MixedPromptBatches(mixed, 16, seed=1)
    assert fresh.taken_before(1500).tolist() == reference[1499].tolist()
    assert list(fresh.batch_at(1500)["uid"]) == list(b.batch_at(1500)["uid"])


def test_unweighted_files_are_one_dataset_and_weighted_ones_a_mix(tmp_path, tokenizer):
    write_rows(make_digits_rows(20, seed=1), tmp_path / "d.parquet")
    write_rows(make_arith_rows(12, seed=2), tmp_path / "a.jsonl")
    files = f"data.train_files=[{tmp_path}/d.parquet, {tmp_path}/a.jsonl]"
    cfg = validate(
        load_config(
            None, [files, "data.max_prompt_length=64", f"data.val_files=[{tmp_path}/d.parquet, {tmp_path}/a.jsonl]"]
        )
    )
    train, val = build_datasets(cfg.data, tokenizer, tmp_path / "work")
    assert isinstance(train, RLDataset) and len(train) == 32 and train.source == "d.parquet+a.jsonl"
    assert isinstance(make_prompt_batches(train, cfg.data), PromptBatches) and data_mix_identity(train) == {}
    assert len(val) == 32 and {r["data_source"] for r in val.rows} == {DIGITS_DATA_SOURCE, ARITH_DATA_SOURCE}
    cfg = validate(load_config(None, [files, "data.train_weights=[1, 3]", "data.max_prompt_length=64"]))
    train, _ = build_datasets(cfg.data, tokenizer, tmp_path / "work")
    assert isinstance(train, MixedDataset) and train.names == ["d", "a"]
    assert data_mix_identity(train) == {"mix": [["d", 20, 0.25], ["a", 12, 0.75]]}
    assert isinstance(make_prompt_batches(train, cfg.data), MixedPromptBatches)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.train_weights=[1, 2]"], r"data\.train_weights is set but data\.train_files is null"),
        (["data.train_files=[{d}]", "data.train_weights=[1, 2]"], r"has 2 weights for 1 data\.train_files"),
        (["data.train_files=[{d}, {d}]", "data.train_weights=[1, 0]"], r"must all be > 0"),
        (["data.train_files=[]"], r"data\.train_files=\[\] names no file"),
        (["data.val_files=[{d}, /nope.jsonl]"], r"data\.val_files='/nope\.jsonl' does not exist"),
        (["data.train_weights=[1, x]"], r"data\.train_weights=\[1, 'x'\] is not a valid list of float"),
    ],
)
def test_mix_options_are_checked(tmp_path, overrides, message):
    write_rows(make_digits_rows(20, seed=1), tmp_path / "d.parquet")
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, [o.format(d=tmp_path / "d.parquet") for o in overrides]))


def test_resume_with_another_mix_is_refused(mixed, tmp_path):
    from megarl.config.schema import RunConfig
    from megarl.trainer.checkpoints import ResumeRefused
    from megarl.trainer.loop import Trainer
    from megarl.trainer.metrics import MetricsLogger

    runtime = SimpleNamespace(
        cfg=RunConfig(),
        run_dir=tmp_path,
        train_data=mixed,
        critic=None,
        prm=None,
        actor=SimpleNamespace(mesh=[SimpleNamespace(dp_size=1)]),
        fleet=SimpleNamespace(on_restart=None),
    )
    trainer = Trainer(runtime, MetricsLogger(None, 1))
    saved = trainer._data_identity()
    assert saved["mix"][0] == ["small", 10, 0.5]
    runtime.train_data = MixedDataset(mixed.parts, [1.0, 1.0, 1.0], mixed.names)
    with pytest.raises(ResumeRefused, match=r"'mix': \[\['small', 10, 0\.5\]"):
        trainer.restore(tmp_path, {"step": 3, "weight_version": 3, "data": saved})


# ------------------------------------------------------------------ validation metrics
def test_pass_and_mean_at_k_by_hand():
    # two sources, k = 3; prompt p0 (a): [1, 0, 0.5], p1 (a): [0, 0, 0], p2 (b): [1, 1, 0.9]
    scores = [1, 0, 0.5, 0, 0, 0, 1, 1, 0.9]
    uids = ["p0"] * 3 + ["p1"] * 3 + ["p2"] * 3
    sources = ["a"] * 6 + ["b"] * 3
    m = validation_metrics(scores, uids, sources, 3, threshold=1.0)
    assert m == pytest.approx(
        {
            "val/reward_mean": 4.4 / 9,
            "val/a/reward_mean": 1.5 / 6,
            "val/a/mean@3": 1 / 6,
            "val/a/pass@3": 1 / 2,
            "val/b/reward_mean": 2.9 / 3,
            "val/b/mean@3": 2 / 3,
            "val/b/pass@3": 1.0,
        },
        abs=1e-12,
    )
    m = validation_metrics(torch.tensor(scores), uids, sources, 3, threshold=0.5)
    assert m["val/a/mean@3"] == pytest.approx(2 / 6) and m["val/b/mean@3"] == 1.0
    with pytest.raises(ValueError, match=r"expects 2 samples per prompt \(trainer\.val_n\)"):
        validation_metrics(scores, uids, sources, 2, 1.0)


def test_validation_over_two_val_files_per_data_source(tmp_path, tokenizer):
    """The trainer's validate(): val_n samples per prompt at val_temperature, metrics per source."""
    from megarl.trainer.loop import Trainer
    from megarl.trainer.metrics import MetricsLogger

    write_rows(make_digits_rows(2, seed=5), tmp_path / "d.jsonl")
    write_rows(make_arith_rows(2, seed=6), tmp_path / "a.jsonl")
    cfg = validate(
        load_config(
            None,
            [
                f"data.val_files=[{tmp_path}/d.jsonl, {tmp_path}/a.jsonl]",
                "trainer.val_n=3",
                "rollout.val_temperature=0.7",
                "data.max_prompt_length=64",
            ],
        )
    )
    _, val = build_datasets(cfg.data, tokenizer, tmp_path / "work")
    # which samples answer right: d0 one of 3, d1 none, a0 all, a1 one
    right = [[1, 0, 0], [0, 0, 0], [1, 1, 1], [0, 1, 0]]
    seen = []

    def generate(prompts, sampling, version):
        seen.append(sampling)
        rows = prompts.repeat_interleave(sampling.n)
        rows["response_text"] = [
            (truth if right[i // sampling.n][i % sampling.n] else "no idea")
            for i, truth in enumerate(rows["ground_truth"])
        ]
        return rows

    runtime = SimpleNamespace(
        cfg=cfg,
        run_dir=tmp_path,
        val_data=val,
        critic=None,
        prm=None,
        actor=SimpleNamespace(mesh=[SimpleNamespace(dp_size=1)]),
        fleet=SimpleNamespace(on_restart=None, engine_urls=[]),
        rollout=SimpleNamespace(generate=generate),
    )
    metrics = Trainer(runtime, MetricsLogger(None, 1)).validate(step=4)
    assert (seen[0].n, seen[0].temperature) == (3, 0.7)
    assert metrics == pytest.approx(
        {
            "val/reward_mean": 5 / 12,
            f"val/{DIGITS_DATA_SOURCE}/reward_mean": 1 / 6,
            f"val/{DIGITS_DATA_SOURCE}/mean@3": 1 / 6,
            f"val/{DIGITS_DATA_SOURCE}/pass@3": 0.5,
            f"val/{ARITH_DATA_SOURCE}/reward_mean": 4 / 6,
            f"val/{ARITH_DATA_SOURCE}/mean@3": 4 / 6,
            f"val/{ARITH_DATA_SOURCE}/pass@3": 1.0,
        }
    )
    # a rollout that lost rows is not summarised as if it had them
    with pytest.raises(ValueError, match="asked for 3 samples of 4 prompts and got 11 rows"):
        run_validation(val, lambda p: generate(p, seen[0], None)[:11], lambda r: torch.zeros(11), 3, 1.0)


def test_val_n_with_greedy_decoding_is_refused():
    with pytest.raises(ConfigError, match=r"trainer\.val_n=4 .* rollout\.val_temperature=0 decodes greedily"):
        validate(load_config(None, ["trainer.val_n=4"]))
    with pytest.raises(ConfigError, match=r"trainer\.val_n=0 must be >= 1"):
        validate(load_config(None, ["trainer.val_n=0"]))
    assert validate(load_config(None, ["trainer.val_n=4", "rollout.val_temperature=1.0"])).trainer.val_n == 4
