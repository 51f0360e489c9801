"""Token-in-token-out agent loops with tools (rollout.agent_loop): base.py (the contract and the
registry), tool_loop.py (multi-turn tool calling), tools.py (tools and the call parser),
sandbox.py (the python tool's confined process), rollout.py (the rows the trainer takes)."""

from megarl.rollout.agent.base import AGENT_LOOPS, AgentLoop, AgentOutput, AgentSample, register_agent_loop
from megarl.rollout.agent.tool_loop import ToolAgentLoop
from megarl.rollout.agent.tools import TOOLS, register_tool

__all__ = [
    "AGENT_LOOPS",
    "AgentLoop",
    "AgentOutput",
    "AgentSample",
    "ToolAgentLoop",
    "TOOLS",
    "register_agent_loop",
    "register_tool",
]
