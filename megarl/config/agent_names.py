"""The names rollout.agent_loop and rollout.agent.tools may take, known to config by name only.

The registries that map a name to its class live with the agent loop (megarl/rollout/agent/:
AGENT_LOOPS, TOOLS), above config; validation needs only the names to refuse a typo before any
process starts. The built-in names are listed here, and tests/config/test_config.py checks they are
exactly the registered ones. A loop or tool registered by user code declares its name here too
(declare_agent_loop / declare_tool), before the config that selects it is validated.
"""

from __future__ import annotations

AGENT_LOOP_NAMES: set[str] = {"single_turn", "tool"}
TOOL_NAMES: set[str] = {"python"}


def declare_agent_loop(name: str) -> None:
    """Let rollout.agent_loop name `name` (the loop registered with register_agent_loop)."""
    AGENT_LOOP_NAMES.add(name)


def declare_tool(name: str) -> None:
    """Let rollout.agent.tools name `name` (the tool registered with register_tool)."""
    TOOL_NAMES.add(name)
