"""Tools the agent loop can call, by name, and the parser of the model's calls.

A call is written the way Hermes and Qwen models write them (Qwen2.5/Qwen3 chat templates):

    <tool_call>
    {"name": "python", "arguments": {"code": "print(23 * 58)"}}
    </tool_call>

`parse_tool_calls(text)` finds every call in one assistant turn. Whatever goes wrong is the
model's mistake and is answered to it as the tool's output, counted as a failed call, never raised:
the body is not JSON, not an object with a string "name" and an object "arguments" (a JSON string
holding an object is accepted, as some models write it), a <tool_call> is not closed or a
</tool_call> opened, the tool is unknown, or the arguments do not match the tool's JSON schema (checked with `jsonschema`).

Tools are registered by name with `@register_tool("name")` on a factory `factory(cfg) -> Tool`,
where cfg is the run's `rollout.agent` section; `rollout.agent.tools` lists the names a run offers.
"""

from __future__ import annotations

import asyncio
import json
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import jsonschema

from megarl.config.agent_names import declare_tool
from megarl.rollout.agent.sandbox import SandboxLimits, run_python

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str | None
    arguments: dict | None
    error: str | None = None  # why the call could not be read (then name/arguments may be None)


@dataclass
class ToolResult:
    text: str  # what the model is shown
    ok: bool  # counted in rollout/tool_call_success_rate


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call>...</tool_call> of `text`, in order, plus one failed call for a
    </tool_call> that closes nothing (the model ended its turn as if it had called) and one for a
    <tool_call> never closed."""
    calls = [_parse_body(m.group(1)) for m in _CALL.finditer(text)]
    rest = _CALL.sub("", text)
    if CALL_CLOSE in rest:
        calls.append(ToolCall(None, None, f"error: {CALL_CLOSE} without {CALL_OPEN}"))
    if CALL_OPEN in rest:
        calls.append(ToolCall(None, None, f"error: {CALL_OPEN} without {CALL_CLOSE}"))
    return calls


def _parse_body(body: str) -> ToolCall:
    try:
        value = json.loads(body.strip())
    except json.JSONDecodeError as exc:
        return ToolCall(None, None, f"error: the tool call is not valid JSON ({exc.msg} at char {exc.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall(None, None, 'error: a tool call is a JSON object {"name": ..., "arguments": {...}}')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], None, f"error: the arguments of {value['name']} must be a JSON object")
    return ToolCall(value["name"], arguments)


class Tool:
    """A tool: its name, a description, a JSON schema of its arguments, and `call`."""

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}}

    async def call(self, **arguments) -> ToolResult:
        raise NotImplementedError  # the interface: every registered tool implements it

    def schema(self) -> dict:
        """The OpenAI-style function description chat templates take (apply_chat_template(tools=...))."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


TOOLS: dict[str, Callable[..., Tool]] = {}


def register_tool(name: str):
    def wrap(factory: Callable[..., Tool]) -> Callable[..., Tool]:
        if name in TOOLS:
            raise ValueError(f"a tool named {name!r} is already registered")
        TOOLS[name] = factory
        declare_tool(name)  # rollout.agent.tools may now name it
        return factory

    return wrap


class ToolBox:
    """The tools of one run, by name; `execute` turns a parsed call into the model's answer."""

    def __init__(self, tools: list[Tool]):
        self.tools = {t.name: t for t in tools}
        for tool in tools:
            jsonschema.Draft202012Validator.check_schema(tool.parameters)

    @classmethod
    def from_config(cls, agent_cfg) -> ToolBox:
        unknown = [n for n in agent_cfg.tools if n not in TOOLS]
        if unknown:
            raise ValueError(f"rollout.agent.tools names unknown tools {unknown}; registered: {sorted(TOOLS)}")
        return cls([TOOLS[name](agent_cfg) for name in agent_cfg.tools])

    async def execute(self, call: ToolCall) -> ToolResult:
        if call.error is not None:
            return ToolResult(call.error, False)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools))}", False)
        try:
            jsonschema.validate(call.arguments, tool.parameters, cls=jsonschema.Draft202012Validator)
        except jsonschema.ValidationError as exc:
            return ToolResult(f"error: bad arguments for {call.name}: {exc.message}", False)
        return await tool.call(**call.arguments)


class PythonTool(Tool):
    """Runs `code` in the sandbox (sandbox.py) and answers its stdout (with why, when it failed)."""

    name = "python"
    description = "Run a Python program and return what it prints."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string"}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(self, limits: SandboxLimits, max_concurrency: int = 2):
        self.limits = limits
        self._max_concurrency = max_concurrency
        # per event loop (every generate call runs its own): a semaphore is bound to one loop
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    async def call(self, code: str) -> ToolResult:
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self._max_concurrency)
        semaphore = self._semaphores[loop]
        async with semaphore:
            result = await asyncio.to_thread(run_python, code, self.limits)
        return ToolResult(result.describe(), result.ok)


@register_tool("python")
def _python_tool(agent_cfg) -> PythonTool:
    s = agent_cfg.sandbox
    limits = SandboxLimits(
        timeout_s=s.timeout_s,
        cpu_s=s.cpu_s,
        memory_mb=s.memory_mb,
        max_output_bytes=s.max_output_bytes,
        file_mb=s.file_mb,
        isolation=s.isolation,
    )
    return PythonTool(limits, s.max_concurrency)
