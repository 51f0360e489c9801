"""The agent loop (megarl/rollout/agent/): token ids in and out across turns, masks over tool
tokens, the tool-call parser's failures answered to the model, sticky engines, the manager's
rows, and the trainer pieces that must skip tool tokens.

A scripted model server (FastAPI in a thread) plays the model where a call must be exact; the
real embedded engine on tiny-qwen3-moe-tools checks that every turn was sent exactly the recorded
ids (its log-probs of the model's tokens equal an HF forward over the final record)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from fastapi import FastAPI, Request

from megarl.config.schema import AgentConfig, SandboxConfig
from megarl.data.batch import Batch
from megarl.models.tiny import TOOLS_PRESET, build_tiny_checkpoint, build_tokenizer
from megarl.rollout.agent.base import AgentSample, EngineHandle
from megarl.rollout.agent.rollout import AgentRollout
from megarl.rollout.agent.tool_loop import ToolAgentLoop, ToolResponseFormat
from megarl.rollout.agent.tools import ToolBox, ToolCall, parse_tool_calls
from megarl.rollout.client.client import RolloutClient
from megarl.rollout.client.manager import RolloutManager, SamplingSpec
from tests._http import ThreadedServer

torch.set_num_threads(1)
TOK = build_tokenizer(tools=True)
EOS = TOK.eos_token_id
FAKE_LOGPROB = -0.25
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(23*58)"}}</tool_call>'


def encode(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def chars(text: str) -> list[int]:
    """`text` one character per token, as a model may spell it (never what encode() makes of it)."""
    return [TOK.convert_tokens_to_ids(c) for c in text]


def prompt_ids(question: str) -> list[int]:
    return TOK.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)


# ---- a scripted model --------------------------------------------------------------------------
def script(question: str, turn: int) -> list[int]:
    """What the 'model' answers on turn `turn` (0-based) of a conversation opened by `question`."""
    if question.startswith("always"):  # calls the tool every turn (max_turns ends it)
        return encode(CALL)
    if question.startswith("errors"):  # a bad call per turn (one call ends a turn), then an answer
        bad = [
            '<tool_call>{"name": "python", "arguments": {"code": 1}}</tool_call>',
            '<tool_call>{"name": "shell", "arguments": {}}</tool_call>',
            '<tool_call>{"name": python}</tool_call>',
        ]
        return encode(bad[turn]) if turn < len(bad) else encode("7") + [EOS]
    if turn == 0:
        return encode(CALL)
    # the answer, preceded by "<|user|>" spelled in characters: decoding the record and encoding
    # it again would turn those 8 ids into the one special token
    return chars("<|user|>") + encode("1334") + [EOS]


def scripted_app(seen: list) -> FastAPI:
    app = FastAPI()
    response_open = TOK.convert_tokens_to_ids("<tool_response>")
    assistant = TOK.convert_tokens_to_ids("<|assistant|>")

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        seen.append(body)
        items = []
        for ids, params in zip(body["input_ids"], [body["sampling_params"]] * len(body["input_ids"])):
            question = TOK.decode(ids[1 : ids.index(assistant)])
            out = script(question, ids.count(response_open))
            stops = set(params.get("stop_token_ids") or [])
            cut = next((k + 1 for k, t in enumerate(out) if t in stops), len(out))
            out, finish = out[:cut], {"type": "stop"}
            if len(out) > params["max_new_tokens"]:
                out, finish = out[: params["max_new_tokens"]], {"type": "length", "length": params["max_new_tokens"]}
            items.append(
                {
                    "text": TOK.decode(out, skip_special_tokens=True),
                    "output_ids": out,
                    "meta_info": {
                        "output_token_logprobs": [[FAKE_LOGPROB, t, None] for t in out],
                        "finish_reason": finish,
                        "weight_version": "default",
                    },
                }
            )
        return items

    return app


class ScriptedServer(ThreadedServer):
    def __init__(self):
        self.seen: list[dict] = []
        super().__init__(scripted_app(self.seen))
        self.start()


@pytest.fixture(scope="module")
def scripted():
    servers = [ScriptedServer(), ScriptedServer()]
    yield servers
    for s in servers:
        s.stop()


def agent_cfg(**kw) -> AgentConfig:
    return AgentConfig(**{"max_turns": 3, "sandbox": SandboxConfig(timeout_s=10), **kw})


def run_one(url: str, question: str, max_tokens: int = 256, **cfg):
    loop = ToolAgentLoop(TOK, agent_cfg(**cfg), max_tokens)
    client = RolloutClient(url, max_retries=0)
    try:
        engine = EngineHandle(client, {"temperature": 1.0}, row=0, weight_version=None)
        return asyncio.run(loop.run(AgentSample(0, prompt_ids(question), engine)))
    finally:
        client.close()


# ---- the tool path, token by token --------------------------------------------------------------
def test_tool_call_runs_in_the_sandbox_and_the_record_is_exact(scripted):
    server = scripted[0]
    server.seen.clear()
    out = run_one(server.url, "what is 23*58?")
    prompt, turn1, turn2 = prompt_ids("what is 23*58?"), encode(CALL), chars("<|user|>") + encode("1334") + [EOS]
    glue = encode("<eos><|user|><tool_response>1334\n</tool_response><|assistant|>")  # the sandbox printed 1334
    assert out.prompt_ids == prompt and out.num_turns == 2 and out.finish_reason == "stop"
    assert out.response_ids == turn1 + glue + turn2  # no re-tokenisation: exactly the pieces, in order
    assert out.response_mask == [1] * len(turn1) + [0] * len(glue) + [1] * len(turn2)
    assert out.response_logprobs == [FAKE_LOGPROB] * len(turn1) + [0.0] * len(glue) + [FAKE_LOGPROB] * len(turn2)
    assert out.extras == {"tool_calls": 1, "tool_successes": 1}
    assert out.text == "<|user|>1334"
    # each turn was sent the exact accumulated ids
    assert [g["input_ids"] for g in server.seen] == [[prompt], [prompt + turn1 + glue]]
    assert server.seen[0]["sampling_params"]["stop_token_ids"] == encode("</tool_call>")
    # decoding the record and encoding it again would not give the same ids: the model's
    # character-spelled "<|user|>" collapses into the special token
    full = prompt + out.response_ids
    assert encode(TOK.decode(full)) != full
    assert len(encode(TOK.decode(full))) == len(full) - 7


def test_failed_calls_are_answered_to_the_model_and_counted(scripted):
    out = run_one(scripted[0].url, "errors please", max_tokens=1024, max_turns=4)
    assert out.num_turns == 4 and out.extras == {"tool_calls": 3, "tool_successes": 0}
    tool_text = TOK.decode([t for t, m in zip(out.response_ids, out.response_mask) if m == 0])
    assert "bad arguments for python: 1 is not of type 'string'" in tool_text
    assert "unknown tool 'shell'; tools: python" in tool_text
    assert "not valid JSON" in tool_text
    assert tool_text.count("<tool_response>") == 3 and tool_text.count("<|assistant|>") == 3


def test_max_turns_and_the_response_budget_end_a_trajectory(scripted):
    out = run_one(scripted[0].url, "always call", max_turns=2)
    assert out.num_turns == 2 and out.finish_reason == "max_turns" and out.extras["tool_calls"] == 1
    assert out.response_mask[-1] == 1  # the unexecuted call is the last thing recorded
    budget = len(encode(CALL)) + 5  # the first tool answer (10 tokens) is cut after 5
    out = run_one(scripted[0].url, "always call", max_tokens=budget)
    assert out.finish_reason == "length" and len(out.response_ids) == budget and out.num_turns == 1
    assert out.response_mask == [1] * len(encode(CALL)) + [0] * 5


def test_parser_edge_cases():
    calls = parse_tool_calls(
        'a<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}</tool_call>'
        '<tool_call>[1]</tool_call> tail <tool_call>{"name"'
    )
    assert calls[0] == ToolCall("python", {"code": "1"})  # arguments as a JSON string are accepted
    assert calls[1].error.startswith("error: a tool call is a JSON object")
    assert calls[2].error == "error: <tool_call> without </tool_call>" and len(calls) == 3
    assert [c.error for c in parse_tool_calls("x</tool_call>")] == ["error: </tool_call> without <tool_call>"]
    assert parse_tool_calls("no calls here") == []
    result = asyncio.run(ToolBox.from_config(agent_cfg()).execute(ToolCall("python", {"code": "print(2)", "x": 1})))
    assert not result.ok and "Additional properties are not allowed" in result.text


def test_tool_response_format_with_a_qwen_template():
    """Qwen2.5's tool rendering: the model's <|im_end|> is not repeated, the rest is glue."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|im_start|>", "<|im_end|>", "<tool_response>", "</tool_response>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="\n"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token a character
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = (  # Qwen2.5's template without the system prompt and tool-call parts
        "{%- for m in messages %}{%- if m.role == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    fmt = ToolResponseFormat(tok)
    expected = "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert fmt.text(["42"]) == expected
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = fmt.ids(["42"], turn_ids=[5, 6, im_end])  # the model ended its turn itself
    assert tok.decode(ids) == expected[len("<|im_end|>") :]
    assert tok.decode(fmt.ids(["42"], turn_ids=[5, 6])) == expected  # stopped at </tool_call>: closed here


# ---- the manager's rows, sticky engines ---------------------------------------------------------
def test_manager_rows_metrics_and_sticky_engines(scripted):
    for s in scripted:
        s.seen.clear()
    questions = ["what is 23*58?", "errors please"]
    prompts = Batch(
        non_tensors={
            "raw_prompt_ids": [prompt_ids(q) for q in questions],
            "data_source": ["megarl/arith"] * 2,
            "ground_truth": ["1334", "7"],
            "extra_info": [{}, {}],
            "uid": ["a", "b"],
        }
    )
    manager = RolloutManager(
        [s.url for s in scripted], max_retries=0, agent=AgentRollout(ToolAgentLoop(TOK, agent_cfg(max_turns=4), 1024))
    )
    delivered = []
    try:
        rows = manager.generate(
            prompts,
            SamplingSpec(n=2, max_new_tokens=1024),
            on_rows=lambda idx, outs: delivered.append((idx, [o.text for o in outs[0]])),
        )
    finally:
        manager.close()
    assert len(rows) == 4 and list(rows["uid"]) == ["a", "a", "b", "b"]
    mask, lp = rows["response_mask"], rows["rollout_log_probs"]
    assert mask.shape == lp.shape == rows["responses"].shape
    assert bool((lp[mask == 0] == 0).all()) and bool((lp[mask == 1] == FAKE_LOGPROB).all())
    for i in range(4):
        n_prompt = int(rows["prompt_lengths"][i])
        k = int((rows["responses"][i] != 0).sum())  # no pad id (0) inside these responses
        assert torch.equal(rows["input_ids"][i, n_prompt : n_prompt + k], rows["responses"][i, :k])
        assert bool((mask[i, :k] == 0).any()) and bool((mask[i, k:] == 0).all())
    assert list(rows["response_text"]) == ["<|user|>1334"] * 2 + ["7"] * 2
    assert list(rows["finish_reason"]) == ["stop"] * 4 and rows["num_turns"].tolist() == [2, 2, 4, 4]
    assert manager.last_stats["rollout/num_turns"] == 3.0
    assert manager.last_stats["rollout/tool_calls"] == 2 * 1 + 2 * 3
    assert manager.last_stats["rollout/tool_call_success_rate"] == pytest.approx(2 / 8)
    assert sorted(delivered) == [([0], ["<|user|>1334"] * 2), ([1], ["7"] * 2)]
    # sticky: engine k got every turn of prompt k's trajectories and nothing else
    for k, server in enumerate(scripted):
        assert len(server.seen) == 2 * (2, 4)[k]  # 2 trajectories x their turns
        assert all(g["input_ids"][0][: len(prompt_ids(questions[k]))] == prompt_ids(questions[k]) for g in server.seen)


# ---- the trainer's pieces skip tool tokens ------------------------------------------------------
def test_lengths_parity_and_advantages_skip_masked_tool_tokens():
    from megarl.algo.advantages import compute_advantages
    from megarl.engine.megatron.packing import row_lengths
    from megarl.trainer.parity import check_parity

    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    assert row_lengths(torch.zeros(2, 9, dtype=torch.long), torch.tensor([3, 3]), mask).tolist() == [8, 6]
    rows = Batch(
        {
            "response_mask": mask,
            "prompt_lengths": torch.tensor([3, 3]),
            "old_log_probs": torch.where(mask > 0, -1.0, -9.0),
            "rollout_log_probs": -mask,
        }
    )
    bridge = SimpleNamespace(check_parity=True, parity_atol=1e-3, parity_rows_off=0.0)
    assert check_parity(rows, 1, bridge, 1, lambda: [])["rollout/logprob_diff_max"] == 0.0
    adv, _ = compute_advantages("grpo", torch.tensor([1.0, 0.0]), mask, ["g", "g"])
    assert bool((adv[mask == 0] == 0).all()) and bool((adv[mask == 1] != 0).all())


# ---- the real engine: every turn sent exactly the recorded ids ----------------------------------
@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tools") / "model", seed=0, preset=TOOLS_PRESET)


def test_real_engine_log_probs_match_hf_over_the_final_record(tools_model, tmp_path):
    """The embedded engine, biased toward tool-call markers so trajectories take several turns
    (the calls are malformed: their errors are the tool answers). An HF forward over prompt +
    the recorded response gives the engine's log-prob at every model token (fp32, 1e-4), so each
    turn's request held exactly the recorded context; tool tokens carry 0."""
    from transformers import AutoModelForCausalLM

    from megarl.rollout.fleet.server_process import RolloutServerProcess

    call_open, call_close = TOK.convert_tokens_to_ids("<tool_call>"), TOK.convert_tokens_to_ids("</tool_call>")
    bias = {call_open: 3.0, call_close: 3.0}
    loop = ToolAgentLoop(TOK, agent_cfg(max_turns=4), 200)
    with RolloutServerProcess(tools_model, port=0, seed=0, torch_threads=1, log_path=tmp_path / "server.log") as server:
        client = RolloutClient(server.url, max_retries=0)

        async def run_all():
            return await asyncio.gather(
                *[
                    loop.run(
                        AgentSample(
                            i,
                            prompt_ids(q),
                            EngineHandle(
                                client,
                                {"temperature": 1.0, "logit_bias": {str(t): b for t, b in bias.items()}},
                                i,
                                None,
                                seed=(0,),
                            ),
                        )
                    )
                    for i, q in enumerate(["what is 2+2?", "compute 17*3", "hello", "x", "a", "bc"])
                ]
            )

        try:
            outs = asyncio.run(run_all())
        finally:
            client.close()
    assert max(o.num_turns for o in outs) >= 3 and sum(o.extras["tool_calls"] for o in outs) >= 4
    model = AutoModelForCausalLM.from_pretrained(tools_model, torch_dtype=torch.float32).eval()
    for out in outs:
        ids = torch.tensor([out.prompt_ids + out.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(out.prompt_ids) - 1 : -1]
        for t, b in bias.items():  # the engine reports log-probs of the processed (biased) logits
            logits[:, t] += b
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(out.prompt_ids) :, None])[:, 0]
        mask = torch.tensor(out.response_mask, dtype=torch.bool)
        got = torch.tensor(out.response_logprobs)
        assert torch.allclose(got[mask], ref[mask], atol=1e-4), (got[mask] - ref[mask]).abs().max()
        assert bool((got[~mask] == 0).all())
        assert (out.extras["tool_calls"] > 0) == bool((~mask).any())  # tool tokens exactly when calls were answered


def test_the_example_task_fits_its_config_and_scores_the_last_turn():
    from megarl.config.loader import load_config
    from megarl.data.dataset import tokenize_prompt
    from megarl.data.tasks import make_arith_tool_rows
    from megarl.reward.rule import arith_tool_score

    cfg = load_config("configs/agent-arith-tool.yaml")
    assert cfg.rollout.agent_loop == "tool" and cfg.model.preset == TOOLS_PRESET
    for row in make_arith_tool_rows(32, seed=1):
        ids = tokenize_prompt(TOK, row["prompt"])
        assert len(ids) <= cfg.data.max_prompt_length and TOK.pad_token_id not in ids  # no unknown character
        x, truth = row["extra_info"], row["reward_model"]["ground_truth"]
        assert x["op"] == "*" and int(truth) == x["a"] * x["b"] and 100 <= x["a"] <= 999 and 10 <= x["b"] <= 99
        assert arith_tool_score(f"so {truth}", truth, {}) == 1.0
        assert arith_tool_score("12", truth, {}) == 0.1 and arith_tool_score("none", truth, {}) == 0.0


def test_the_sft_transcripts_hold_what_the_sandboxed_tool_answers():
    """The cold start's transcripts (sft.task arith_tool): each call, run by the python tool in its
    sandbox, answers exactly the tool message that follows it, and the number is that answer."""
    from megarl.data.tasks import make_arith_tool_chats

    toolbox = ToolBox.from_config(agent_cfg())
    for chat in make_arith_tool_chats(6, seed=5):
        user, call, tool, answer = chat["messages"]
        [parsed] = parse_tool_calls(call["content"])
        result = asyncio.run(toolbox.execute(parsed))
        assert result.ok and result.text == tool["content"] and tool["content"] == answer["content"] + "\n"
