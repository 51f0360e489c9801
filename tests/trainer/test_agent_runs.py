"""The agent example as a user runs it, shrunk: configs/agent-arith-tool-sft.yaml (`megarl sft`,
its full length: ~150 short steps), then configs/agent-arith-tool.yaml from its export through the
Trainer (Ray, two Megatron ranks with EP=2, the embedded engine, the sandboxed python tool).

What the model does is its own: the SFT run taught it to call python, and the rows below are the
calls it sampled. A call that ran is followed in the row by exactly the tokens of the tool's
answer (the product, computed here), with response_mask 0 and rollout log-prob 0, after the
model's call tokens with mask 1; the engine's log-probs of the next turn equal the trainer's over
the whole row, so the engine was sent those tokens. A call to a tool the run does not offer is
answered to the model as an error, counted as a failed call, and the step goes on.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch

from tests._parity import assert_served_by_the_trainers_weights

ROOT = Path(__file__).resolve().parents[2]
SFT_CONFIG, RL_CONFIG = ROOT / "configs/agent-arith-tool-sft.yaml", ROOT / "configs/agent-arith-tool.yaml"
PRODUCT_CALL = re.compile(
    r'^<tool_call>\{"name": "python", "arguments": \{"code": "print\((\d+) \* (\d+)\)"\}\}</tool_call>$'
)


class _Recording:
    """A rollout source that keeps every step's scored rows, as the trainer receives them."""

    def __init__(self, inner):
        self.inner, self.off_policy, self.rows_of = inner, inner.off_policy, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def rows(self, step, timing):
        rows, stats = self.inner.rows(step, timing)
        self.rows_of[step] = rows
        return rows, stats


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.config.validate_sft import validate_sft
    from megarl.models.tiny import PRESETS
    from megarl.rollout.agent.tools import ToolBox
    from megarl.trainer.loop import Trainer
    from megarl.trainer.metrics import MetricsLogger
    from megarl.trainer.runtime import start_runtime
    from megarl.trainer.sft_run import prepare_sft_data, run_sft

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("agent")
    sft_cfg = validate_sft(load_config(SFT_CONFIG, [f"trainer.output_dir={out}"]), PRESETS["tiny-qwen3-moe-tools"])
    run_sft(sft_cfg, prepare_sft_data(sft_cfg), stream=io.StringIO())
    sft_dir = out / "agent-arith-tool-sft"
    cfg = validate(
        load_config(
            RL_CONFIG,
            [
                f"model.path={sft_dir}/hf",
                f"trainer.output_dir={out}",
                "trainer.total_steps=2",
                "trainer.export_hf=false",
                "trainer.deterministic=true",
                "data.num_train=16",
                "data.num_val=0",
                "trainer.val_every=0",
                "trainer.val_before_train=false",
                "data.train_batch_size=2",
                "rollout.n=4",
                "actor.ppo_mini_batch_size=8",
                "actor.micro_batch_size=4",
            ],
        )
    )
    with start_runtime(cfg) as rt:
        trainer = Trainer(rt, MetricsLogger(None, 3, stream=io.StringIO(), jsonl_path=out / "rl.jsonl"))
        trainer.source = recorder = _Recording(trainer.source)
        trainer.fit()
        rt.rollout.agent.loop.toolbox = ToolBox([])  # step 3 offers no tool: every call names an unknown one
        no_tools = trainer.train_step(3)
        tokenizer = rt.tokenizer
    steps = [json.loads(x) for x in (out / "rl.jsonl").read_text().splitlines()]
    return {
        "sft_dir": sft_dir,
        "steps": steps,
        "rows": recorder.rows_of,
        "no_tools": no_tools,
        "tok": tokenizer,
    }


def _pieces(rows, i: int) -> tuple[list[int], list[int], list[float]]:
    """Row i's response ids, mask and rollout log-probs, up to its last token (pad id 0 after)."""
    ids = rows["responses"][i].tolist()
    end = max((j + 1 for j, t in enumerate(ids) if t != 0), default=0)
    return ids[:end], [int(m) for m in rows["response_mask"][i, :end]], rows["rollout_log_probs"][i, :end].tolist()


def test_the_sft_config_teaches_the_call(runs):
    from megarl.config.loader import load_config

    sft = json.loads((runs["sft_dir"] / "summary.json").read_text())
    assert sft["steps"] == load_config(SFT_CONFIG).sft.total_steps, sft
    assert sft["first_mean"] > 3.0 and sft["last_mean"] < 0.1 * sft["first_mean"], sft
    assert (runs["sft_dir"] / "hf" / "config.json").is_file()


def test_a_call_the_model_made_ran_and_its_answer_entered_the_next_turn_masked(runs):
    tok, close = runs["tok"], runs["tok"].convert_tokens_to_ids("</tool_call>")
    checked = 0
    for step in (1, 2):
        rows = runs["rows"][step]
        for i in range(len(rows)):
            ids, mask, logprobs = _pieces(rows, i)
            if close not in ids:
                continue
            k = ids.index(close) + 1  # the model's first turn ends at </tool_call>
            match = PRODUCT_CALL.match(tok.decode(ids[:k]))
            if match is None:
                continue  # a malformed or other call: its answer is an error (next test)
            a, b = map(int, match.groups())
            answer = f"<eos><|user|><tool_response>{a * b}\n</tool_response><|assistant|>"
            glue = tok.encode(answer, add_special_tokens=False)
            assert mask[:k] == [1] * k  # the model's own call: trained on
            assert ids[k : k + len(glue)] == glue, tok.decode(ids[k : k + len(glue)])  # the tool's real answer
            assert mask[k : k + len(glue)] == [0] * len(glue)  # masked from the loss
            assert logprobs[k : k + len(glue)] == [0.0] * len(glue)
            assert str(a * b) in tok.decode(ids[k : k + len(glue)])
            if len(ids) > k + len(glue):
                assert mask[k + len(glue)] == 1  # the next turn is the model's again
            inputs = rows["input_ids"][i, int(rows["prompt_lengths"][i]) :][: len(ids)].tolist()
            assert inputs == ids  # the trainer's rows hold the tokens the engine continued from
            checked += 1
    assert checked >= 2, "the SFT'd model made fewer than 2 product calls in 16 trajectories"
    for m in runs["steps"]:
        assert m["rollout/tool_calls"] > 0 and m["rollout/tool_call_success_rate"] > 0, m
        assert_served_by_the_trainers_weights(m)  # the engine saw exactly these tokens, turn after turn


def test_a_call_to_an_unknown_tool_is_answered_as_an_error_and_counted(runs):
    m, rows, tok = runs["no_tools"], runs["rows"][3], runs["tok"]
    assert m["rollout/tool_calls"] > 0 and m["rollout/tool_call_success_rate"] == 0.0
    assert_served_by_the_trainers_weights(m)
    answered = 0
    for i in range(len(rows)):
        ids, mask, _ = _pieces(rows, i)
        tool_text = tok.decode([t for t, keep in zip(ids, mask) if keep == 0])
        answered += "error: unknown tool 'python'; tools: " in tool_text
    assert answered >= 1
