"""The multi-turn tool-calling loop (`rollout.agent_loop: tool`).

    turn: the model generates (it stops at </tool_call> or its end of turn)
          no tool call -> done (finish_reason stop)
          calls -> run them (tools.py), append their answers in the chat template's tool format
          (mask 0), next turn; after rollout.agent.max_turns model turns -> done (max_turns)
          the response budget (rollout.max_new_tokens) spent -> done (length)

Tool answers are wrapped by the model's own chat template (ToolResponseFormat): for Qwen2.5/3
`<|im_end|>\n<|im_start|>user\n<tool_response>\n...\n</tool_response><|im_end|>\n<|im_start|>assistant\n`.
Those ids are tokenised once, on their own, and appended: the history already sent is never
re-tokenised. The reward reads the model's last turn (its text as the engine decoded it).
"""

from __future__ import annotations

import asyncio

from megarl.rollout.agent.base import AgentLoop, AgentOutput, AgentSample, Trajectory, register_agent_loop
from megarl.rollout.agent.tools import CALL_CLOSE, ToolBox, parse_tool_calls

_SENTINEL = "MEGARLASSISTANTTURN"


class ToolResponseFormat:
    """The ids that follow a model turn which called tools: the template's end of that turn, the
    tool messages, and the next assistant header - what `apply_chat_template` renders after the
    assistant's content for [user, assistant, tool...] with add_generation_prompt."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, results: list[str]) -> str:
        messages = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": _SENTINEL},
            *[{"role": "tool", "content": r} for r in results],
        ]
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if rendered.count(_SENTINEL) != 1:
            raise ValueError(
                "the chat template does not render an assistant message's content verbatim; "
                "ToolResponseFormat cannot find where the tool messages start"
            )
        return rendered[rendered.index(_SENTINEL) + len(_SENTINEL) :]

    def ids(self, results: list[str], turn_ids: list[int]) -> list[int]:
        """The glue ids after a model turn `turn_ids`; the end-of-turn tokens the model already
        generated (Qwen's <|im_end|>) are not repeated."""
        ids = self.tokenizer.encode(self.text(results), add_special_tokens=False)
        overlap = next((k for k in range(min(len(ids), len(turn_ids)), 0, -1) if turn_ids[-k:] == ids[:k]), 0)
        return ids[overlap:]


def stop_params(tokenizer) -> dict:
    """Sampling params that end a turn at </tool_call>: the token itself when it is one token
    (Qwen's 151658, tiny-qwen3-moe-tools'), else the stop string."""
    ids = tokenizer.encode(CALL_CLOSE, add_special_tokens=False)
    if len(ids) == 1:
        return {"stop_token_ids": ids}
    return {"stop": [CALL_CLOSE], "skip_special_tokens": False, "no_stop_trim": True}


@register_agent_loop("tool")
class ToolAgentLoop(AgentLoop):
    def __init__(self, tokenizer, cfg, max_response_tokens: int, toolbox: ToolBox | None = None):
        super().__init__(tokenizer, cfg, max_response_tokens)
        self.toolbox = toolbox if toolbox is not None else ToolBox.from_config(cfg)
        self.format = ToolResponseFormat(tokenizer)
        self.format.text(["check"])  # a template without tool messages fails here, not mid-rollout
        self.stop = stop_params(tokenizer)

    async def run(self, sample: AgentSample) -> AgentOutput:
        traj = Trajectory(sample.prompt_ids, self.max_response_tokens)
        calls = successes = turns = 0
        finish, text = "stop", ""
        while True:
            out = await sample.engine.generate(traj.context, traj.remaining, **self.stop)
            turns += 1
            traj.add_model(out.output_ids, out.output_logprobs)
            text = out.text
            if out.finish_reason.get("type") == "length" or traj.remaining <= 0:
                finish = "length"
                break
            found = parse_tool_calls(self.tokenizer.decode(out.output_ids, skip_special_tokens=False))
            if not found:
                break
            if turns >= self.cfg.max_turns:
                finish = "max_turns"
                break
            found = found[: self.cfg.max_tool_calls_per_turn]
            results = await asyncio.gather(*[self.toolbox.execute(c) for c in found])
            calls += len(results)
            successes += sum(r.ok for r in results)
            if not traj.add_tool(self.format.ids([r.text for r in results], out.output_ids)) or traj.remaining <= 0:
                finish = "length"
                break
        return traj.output(
            turns,
            text=text,
            finish_reason=finish,
            weight_version=sample.engine.versions[-1],
            extras={"tool_calls": calls, "tool_successes": successes},
        )
