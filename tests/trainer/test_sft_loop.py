"""The SFT loop's bookkeeping without processes: the logged loss is the exact token mean over a
step's whole batch, and a resume onto other data is refused before the actor is touched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def test_the_logged_loss_is_the_token_mean_over_every_micro_batch_and_rank():
    """Two data-parallel ranks with two micro-batches each, of 3, 10, 1 and 6 loss tokens: the
    engine averages each rank's micro-batch metrics, the driver averages the ranks, and batch_loss
    must still give sum(NLL) / sum(tokens) of the whole batch (not a mean of means)."""
    from megarl.data.batch import Batch
    from megarl.engine.megatron.actor import ActorLossSpec, sft_loss
    from megarl.engine.megatron.engine import mean_metrics
    from megarl.trainer.sft import batch_loss
    from megarl.trainer.step_metrics import average

    gen = torch.Generator().manual_seed(0)
    spec, per_rank, total, tokens = ActorLossSpec(objective="sft"), [], 0.0, 0.0
    for counts in ((3, 10), (1, 6)):
        micro = []
        for n in counts:
            mask = torch.zeros(2, 8)
            mask.view(-1)[:n] = 1
            log_prob = -torch.rand(2, 8, generator=gen) * 3
            micro.append(sft_loss(spec, log_prob, torch.zeros(2, 8), Batch({"response_mask": mask}))[2])
            total, tokens = total - float((log_prob * mask).sum()), tokens + n
        per_rank.append(mean_metrics(micro))
    mean_of_means = sum(m["sft/nll_sum"] / m["sft/loss_tokens"] for m in per_rank) / 2
    assert batch_loss(average(per_rank)) == pytest.approx(total / tokens, rel=1e-6)
    assert abs(mean_of_means - total / tokens) > 1e-3  # the naive mean would differ


def test_resume_onto_other_sft_data_is_refused_before_loading_anything(tmp_path):
    from megarl.config.schema import RunConfig
    from megarl.data.sft import SFTDataset
    from megarl.models.tiny import build_tokenizer
    from megarl.trainer import run_state
    from megarl.trainer.checkpoints import ResumeRefused
    from megarl.trainer.metrics import MetricsLogger
    from megarl.trainer.sft import SFTData, SFTLoop

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the actor was used ({name}) before the data check")

    chats = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * k}]} for k in (1, 2)
    ]
    train = SFTDataset(chats, build_tokenizer(), 16)
    cfg = RunConfig()
    cfg.sft.batch_size = 2
    runtime = SimpleNamespace(cfg=cfg, run_dir=tmp_path, actor=SimpleNamespace(mesh=[SimpleNamespace(dp_size=1)]))
    loop = SFTLoop(runtime, MetricsLogger(None, 1), SFTData(train, None, 1, 1))
    runtime.actor = Untouchable()
    state = {"step": 1, "weight_version": 1, "data": {**loop._data_identity(), "tokens": train.tokens() + 1}}
    with pytest.raises(ResumeRefused, match="'tokens'"):
        run_state.restore(loop, tmp_path, state)  # what fit does first with a resume point


def _sft_config(*overrides):
    from pathlib import Path

    from megarl.config.loader import load_config
    from megarl.config.validate_sft import validate_sft
    from megarl.models.tiny import PRESETS

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs/agent-arith-tool-sft.yaml", list(overrides))
    return validate_sft(cfg, PRESETS[cfg.model.preset])


def test_sft_task_generates_the_transcripts_in_the_driver():
    """sft.task=arith_tool: num_train conversations with sft.seed and num_val with seed + 1, the
    rows make_arith_tool_chats gives, rendered and masked as a file's rows would be."""
    from megarl.data.sft import tokenize_chat
    from megarl.data.tasks import make_arith_tool_chats
    from megarl.models.tiny import build_tokenizer
    from megarl.trainer.sft_run import prepare_sft_data

    data = prepare_sft_data(_sft_config("sft.num_train=40", "sft.num_val=6", "sft.seed=3", "sft.total_steps=null"))
    tok = build_tokenizer(tools=True)
    assert (len(data.train), len(data.val), data.steps_per_epoch, data.total_steps) == (40, 6, 2, 2)
    assert data.train.examples == [tokenize_chat(tok, r["messages"]) for r in make_arith_tool_chats(40, 3)]
    assert data.val.examples == [tokenize_chat(tok, r["messages"]) for r in make_arith_tool_chats(6, 4)]
    assert data.train.source == "sft.task=arith_tool (seed 3)"


@pytest.mark.parametrize(
    "overrides,key,message",
    [
        (["sft.train_files=configs/data/sft-arith-tool-train.jsonl"], "sft.task", "names them too; set one"),
        (["sft.task=null"], "sft.train_files", "or generates them: sft.task=arith_tool"),
        (["sft.num_val=0"], "trainer.val_every", "nothing to validate on"),
        (["sft.num_train=0"], "sft.num_train", "sft.num_train=0 must be >= 1"),
        (["sft.task=digits"], "sft.task", "'arith_tool'"),
    ],
)
def test_sft_task_refusals_name_the_key(overrides, key, message):
    from megarl.config.loader import ConfigError

    with pytest.raises(ConfigError) as err:
        _sft_config(*overrides)
    assert err.value.key == key and message in str(err.value), str(err.value)
