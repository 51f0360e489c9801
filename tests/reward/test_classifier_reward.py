"""The classifier reward (megarl/reward/{seqcls,classifier,classifier_worker,normalize,model}.py).

Scores are checked against Hugging Face's own forward in float64 on CPU, one row at a time with
pad_token_id unset (so HF pools the row's last token, with no padding anywhere): float32 scores
agree to 1e-4 (the heads are scaled so scores are O(1)). The worker group is real (Ray, two
RewardModelWorker ranks); normalisation is checked against numpy over every batch so far; the
configuration checks through `megarl train`, which must exit 2 before anything starts.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megarl.config.schema import RewardConfig, RewardModelConfig
from megarl.data.batch import Batch
from megarl.models.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer
from megarl.reward.classifier import ClassifierReward, ClassifierWorkers
from megarl.reward.model import RowScorer
from megarl.reward.normalize import EPS, ScoreNormalizer
from megarl.reward.registry import RewardError
from megarl.reward.rule import digits_score
from megarl.reward.seqcls import load_classifier, sequence_scores
from tests._reward_models import hf_float64, save_reward_model

torch.set_num_threads(1)
TOL = 1e-4


def random_sequences(n: int, seed: int = 0, vocab: int = 64) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    seqs = [
        torch.randint(0, vocab, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    seqs[0][-1] = seqs[1][-1] = 0  # ending in the pad id: HF's own batched pooling would skip it
    return seqs


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen2", "tiny-llama", "tiny-qwen3-moe"])
def test_sequence_scores_equal_hf_float64_in_padded_sorted_batches(tmp_path, preset):
    path = save_reward_model(tmp_path / preset, preset)
    seqs = random_sequences(11)
    with torch.no_grad():
        got = sequence_scores(load_classifier(path), seqs, batch_size=4).numpy()  # 3 micro-batches, padded
    want = hf_float64(path, seqs)
    assert np.abs(want).max() > 0.1  # scores of size, so the tolerance means something
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


# ---- the worker group ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reward_group(tmp_path_factory):
    from megarl.controller.cluster import RayCluster
    from megarl.controller.worker_group import RayWorkerGroup
    from megarl.reward.classifier_worker import RewardModelWorker

    path = save_reward_model(tmp_path_factory.mktemp("rm") / "rm")
    with RayCluster(num_cpus=2, log_to_driver=False):
        group = RayWorkerGroup(
            RewardModelWorker,
            2,
            init_args=(path, 3),
            num_cpus_per_worker=0.5,
            env_vars={"MEGARL_NUM_THREADS": "1"},
            name_prefix="rm_test",
        )
        try:
            yield ClassifierWorkers(group, path, group.max_length())
        finally:
            group.shutdown()


def policy_row(digits: str, response_ids: list[int], tok) -> dict:
    messages = [{"role": "user", "content": digits}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    return {
        "messages": messages,
        "prompt_ids": prompt,
        "response_ids": response_ids,
        "response": tok.decode(response_ids, skip_special_tokens=True),
    }


def test_the_worker_groups_scores_equal_hf_float64(reward_group):
    tok = build_tokenizer()
    reward = ClassifierReward(reward_group, policy_tokenizer=tok)
    assert reward.reuse_ids  # the same character tokenizer: the policy's ids are scored as they are
    # prompts of 1 to 7 digits: rows of different lengths share micro-batches (padded)
    rows = [
        policy_row(f"{i}" * (1 + i % 4) + "3" * (i % 3), [7 + i % 10, 1] if i % 3 else [60, 0], tok) for i in range(9)
    ]
    got = reward.score(rows)
    want = hf_float64(reward_group.path, [r["prompt_ids"] + r["response_ids"] for r in rows])
    np.testing.assert_allclose(np.array(got), want, atol=TOL, rtol=0)
    # fewer rows than ranks: the idle rank gets none
    np.testing.assert_allclose(reward.score(rows[:1]), want[:1], atol=TOL, rtol=0)


def test_a_different_tokenizer_scores_the_decoded_conversation_in_its_own_template(tmp_path, reward_group):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIAL_TOKENS + list("0123456789abcdefghijklmnopqrstuvwxyz +-*=?:,.\n")
    vocab = {t: len(tokens) - 1 - i for i, t in enumerate(tokens)}  # the same tokens, other ids
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    rm_tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")
    rm_tok.chat_template = CHAT_TEMPLATE.replace("{% endfor %}", "{% endfor %}<eos>")
    path = save_reward_model(tmp_path / "rm", tokenizer=rm_tok)
    policy = build_tokenizer()
    reward = ClassifierReward(ClassifierWorkers(reward_group.group, path, 256), policy_tokenizer=policy)
    assert not reward.reuse_ids
    row = policy_row("382", [policy.convert_tokens_to_ids("7"), 60, policy.eos_token_id], policy)
    expected = [vocab[t] for t in ["<|user|>", "3", "8", "2", "<|assistant|>", "7", "<eos>"]]
    assert reward.sequence(row) == expected  # decoded ("7": id 60 and the eos say nothing), re-encoded


# ---- the scorer: normalisation, combination, failures, overlap --------------------------------------
def rollout_batch(digits: list[str], responses: list[list[int]], tok) -> Batch:
    rows = [policy_row(d, r, tok) for d, r in zip(digits, responses)]
    width = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    resp_width = max(len(r["response_ids"]) for r in rows)
    pad = lambda ids, w: ids + [0] * (w - len(ids))  # noqa: E731
    return Batch(
        tensors={
            "input_ids": torch.tensor([pad(r["prompt_ids"] + r["response_ids"], width) for r in rows]),
            "prompt_lengths": torch.tensor([len(r["prompt_ids"]) for r in rows]),
            "responses": torch.tensor([pad(r["response_ids"], resp_width) for r in rows]),
            "response_mask": torch.tensor([pad([1.0] * len(r["response_ids"]), resp_width) for r in rows]),
        },
        non_tensors={
            "raw_prompt": [r["messages"] for r in rows],
            "raw_prompt_ids": [r["prompt_ids"] for r in rows],
            "data_source": ["megarl/digits"] * len(rows),
            "response_text": [r["response"] for r in rows],
            "ground_truth": [d[-1] for d in digits],
            "extra_info": [{}] * len(rows),
        },
    )


def batches(tok, count: int = 3, size: int = 6, n: int = 2) -> list[Batch]:
    """`count` batches of `size` rows, n responses per prompt (prompt-major, as generated)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        digits = [d for d in (f"{rng.integers(1000):03d}" for _ in range(size // n)) for _ in range(n)]
        out.append(rollout_batch(digits, [[int(rng.integers(5, 15)), 1] for _ in digits], tok))
    return out


def raw_of(workers, batch: Batch) -> np.ndarray:
    lengths = batch["prompt_lengths"] + batch["response_mask"].sum(1).long()
    return hf_float64(workers.path, [ids[:n].tolist() for ids, n in zip(batch["input_ids"], lengths)])


def classifier_scorer(workers, **model) -> RowScorer:
    overlap = model.pop("overlap", False)
    cfg = RewardConfig(model=RewardModelConfig(kind="classifier", path=workers.path, **model), overlap=overlap)
    return RowScorer(cfg, workers=workers, policy_tokenizer=build_tokenizer())


def test_running_normalisation_over_every_training_batch_and_frozen_validation(reward_group):
    tok = build_tokenizer()
    s = classifier_scorer(reward_group, normalize="running", log_ground_truth=True)
    seen = []
    for batch in batches(tok):
        got = s.score_batch(batch).numpy()
        seen.append(raw_of(reward_group, batch))
        everything = np.concatenate(seen)
        np.testing.assert_allclose(got, (seen[-1] - everything.mean()) / (everything.std() + EPS), atol=TOL)
        metrics = s.take_metrics()
        rule = [digits_score(t, g, {}) for t, g in zip(batch["response_text"], batch["ground_truth"])]
        assert metrics["reward/ground_truth_mean"] == pytest.approx(np.mean(rule), abs=1e-7)
        assert metrics["reward/model_mean"] == pytest.approx(seen[-1].mean(), abs=TOL)
        assert metrics["reward/model_norm_std"] == pytest.approx(everything.std(), abs=TOL)
    val = batches(tok, 1, 4)[0]
    frozen = s.score_batch(val, train=False).numpy()  # validation: the statistics as they are
    np.testing.assert_allclose(
        frozen, (raw_of(reward_group, val) - everything.mean()) / (everything.std() + EPS), atol=TOL
    )
    assert s.normalizer.count == sum(len(b) for b in batches(tok))
    s.close()


def test_batch_whitening_and_combine_add(reward_group):
    tok = build_tokenizer()
    s = classifier_scorer(reward_group, normalize="batch", combine="add")
    batch = batches(tok, 1)[0]
    raw = raw_of(reward_group, batch)
    rule = np.array([digits_score(t, g, {}) for t, g in zip(batch["response_text"], batch["ground_truth"])])
    np.testing.assert_allclose(s.score_batch(batch).numpy(), rule + (raw - raw.mean()) / (raw.std() + EPS), atol=TOL)
    s.close()


def test_overlapped_pieces_are_normalised_over_the_whole_batch(reward_group):
    tok = build_tokenizer()
    n, batch = 2, batches(tok, 1, 6)[0]
    prompts = batch[list(range(0, 6, n))].select(*[k for k in batch.non_tensors if k != "response_text"])
    s = classifier_scorer(reward_group, overlap=True)
    overlap = s.start_overlap(prompts, n)
    outputs = [
        SimpleNamespace(text=batch["response_text"][i], output_ids=batch["responses"][i].tolist()) for i in range(6)
    ]
    overlap.on_rows([2], [outputs[4:6]])
    overlap.on_rows([0, 1], [outputs[0:2], outputs[2:4]])
    raw = raw_of(reward_group, batch)
    np.testing.assert_allclose(overlap.collect(batch).numpy(), (raw - raw.mean()) / (raw.std() + EPS), atol=TOL)
    s.close()


def test_a_row_the_model_cannot_take_raises_or_falls_back_and_is_left_out_of_the_statistics(reward_group):
    tok = build_tokenizer()
    rows = rollout_batch(["123", "456", "789", "012", "38211"], [[7, 1], [8], [9, 1], [10, 60], [7, 1]], tok)
    batch = rows[[0, 1, 2, 3]]
    short = ClassifierWorkers(reward_group.group, reward_group.path, max_length=7)  # row 4: 7 + 2 tokens
    with pytest.raises(RewardError, match=r"row 4 .* 9 tokens; the reward model scores 1 to 7"):
        classifier_scorer(short).score_batch(rows)
    s = classifier_scorer(short, on_failure="fallback", fallback_score=-3.0)
    got = s.score_batch(rows).numpy()
    raw = raw_of(reward_group, batch)
    np.testing.assert_allclose(got[:4], (raw - raw.mean()) / (raw.std() + EPS), atol=TOL)
    assert got[4] == -3.0 and s.take_metrics()["reward/model_failures"] == 1.0
    s.close()


# ---- normalisation on its own ------------------------------------------------------------------------
def test_normalizer_modes_and_state():
    parts = [np.array([1.0, 2.0, 4.0]), np.array([10.0]), np.array([-3.0, 0.5])]
    running, batch = ScoreNormalizer("running"), ScoreNormalizer("batch")
    frozen_first = running(np.array([5.0, 7.0]), train=False)  # no statistics yet: its own
    np.testing.assert_allclose(frozen_first, [-1.0, 1.0], atol=1e-5)
    for k, part in enumerate(parts):
        seen = np.concatenate(parts[: k + 1])
        np.testing.assert_allclose(running(part, train=True), (part - seen.mean()) / (seen.std() + EPS), atol=1e-12)
        np.testing.assert_allclose(batch(part, train=True), (part - part.mean()) / (part.std() + EPS), atol=1e-12)
    state = json.loads(json.dumps(running.state_dict()))  # as a checkpoint stores it
    restored = ScoreNormalizer("running")
    restored.load_state_dict(state)
    probe = np.array([0.0, 3.0])
    np.testing.assert_allclose(restored(probe, train=False), running(probe, train=False), atol=0)
    np.testing.assert_allclose(batch(probe, train=False), (probe - parts[-1].mean()) / (parts[-1].std() + EPS))
    with pytest.raises(ValueError, match="normalize=running"):
        ScoreNormalizer("batch").load_state_dict(state)
    assert ScoreNormalizer("none")(probe, train=True).tolist() == probe.tolist()


# ---- bad input: one line, exit 2, nothing started ------------------------------------------------
@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    from megarl.models.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("folders")
    two = save_reward_model(root / "two_labels")
    config = json.loads((root / "two_labels/config.json").read_text())
    config["id2label"], config["label2id"] = {"0": "bad", "1": "good"}, {"bad": 0, "good": 1}
    (root / "two_labels/config.json").write_text(json.dumps(config))
    return {
        "lm": str(build_tiny_checkpoint(root / "lm", preset="tiny-qwen3")),
        "two": two,
        "ok": save_reward_model(root / "ok"),
        "missing": str(root / "nowhere"),
    }


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["reward.model.path={missing}"], r"reward\.model\.path=.*nowhere' does not exist"),
        (["reward.model.path={lm}"], r"has no sequence-classification head .*Qwen3ForCausalLM"),
        (["reward.model.path={two}"], r"its head gives 2 scores per sequence \(num_labels=2\)"),
        ([], r"needs exactly one of reward\.model\.path .* and reward\.model\.preset"),
        (["reward.model.path={ok}", "reward.model.preset=tiny-digits-rm"], r"needs exactly one of"),
        (["reward.model.preset=tiny-rm"], r"reward\.model\.preset='tiny-rm' is not a reward model preset"),
        (["reward.model.path={ok}", "reward.model.num_workers=3"], r"at most cluster\.num_actor_ranks=2"),
    ],
)
def test_a_bad_reward_model_stops_megarl_train_with_one_line_before_anything_starts(
    model_folders, tmp_path, capsys, overrides, message
):
    import re
    from pathlib import Path

    from megarl.cli import main

    config = str(Path(__file__).resolve().parents[2] / "configs/quickstart.yaml")
    given = [o.format(**model_folders) for o in overrides]
    args = [config, "reward.model.kind=classifier", *given, f"trainer.output_dir={tmp_path}"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("megarl: config error: reward.model."), err
    assert re.search(message, err), err
    assert not any(tmp_path.iterdir())  # no run dir: nothing was started


def test_a_reward_model_folder_with_one_score_per_sequence_validates(model_folders):
    from pathlib import Path

    from megarl.config.loader import load_config
    from megarl.config.validate import validate

    config = Path(__file__).resolve().parents[2] / "configs/quickstart.yaml"
    cfg = validate(load_config(config, ["reward.model.kind=classifier", f"reward.model.path={model_folders['ok']}"]))
    assert (cfg.reward.model.normalize, cfg.reward.overlap) == ("running", True)  # the classifier's autos
