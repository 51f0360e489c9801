"""The agent loop's contract: a sample in, a token-level trajectory out.

    class MyLoop(AgentLoop):
        async def run(self, sample: AgentSample) -> AgentOutput:
            traj = Trajectory(sample.prompt_ids, self.max_response_tokens)
            out = await sample.engine.generate(traj.context, traj.remaining)   # the model's turn
            traj.add_model(out.output_ids, out.output_logprobs)
            traj.add_tool(ids_of_some_environment_text)                        # masked out
            ...
            return traj.output(num_turns, text=out.text, finish_reason=...)
    register_agent_loop("mine")(MyLoop)          # rollout.agent_loop=mine

Token ids in, token ids out: every turn sends the exact ids accumulated so far (prompt, the
engine's own output ids, the tool tokens as appended), never decoded-and-re-tokenised text, so
the trainer scores exactly the tokens the engine sampled and conditioned on. `response_mask` is
1 on tokens the model generated (their rollout log-probs are the engine's) and 0 on tool output
and chat-template glue (their log-probs are 0 and the loss, advantages and parity check skip them).

`rollout.max_new_tokens` bounds the whole response (every turn's model and tool tokens): a turn
may generate what is left, and tool tokens beyond it are cut (finish_reason "length").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from megarl.config.agent_names import declare_agent_loop
from megarl.rollout.client.client import GenerateOutput, RolloutClient


@dataclass
class AgentOutput:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1: the model's token, 0: tool output / template glue
    response_logprobs: list[float]  # the engine's log-prob where mask is 1, else 0.0
    num_turns: int  # the model's turns (generate calls)
    text: str = ""  # what the reward reads: the model's last turn
    finish_reason: str = "stop"  # stop | length | max_turns
    weight_version: str | None = None  # the engine's version in the last turn
    extras: dict = field(default_factory=dict)  # tool_calls, tool_successes, ...


class Trajectory:
    """The growing token record of one trajectory (module doc), with the response budget."""

    def __init__(self, prompt_ids: list[int], max_response_tokens: int):
        self.prompt_ids = list(prompt_ids)
        self.max_response_tokens = max_response_tokens
        self.response_ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.pieces: list[tuple[int, int, int]] = []  # (start, end, mask) of each appended piece

    @property
    def context(self) -> list[int]:
        """The ids the next turn is sent: prompt + every response token so far."""
        return self.prompt_ids + self.response_ids

    @property
    def remaining(self) -> int:
        return self.max_response_tokens - len(self.response_ids)

    def add_model(self, ids: list[int], logprobs: list[float] | None) -> None:
        if logprobs is None or len(logprobs) != len(ids):
            raise RuntimeError(
                f"the engine answered {len(ids)} tokens with "
                f"{'no' if logprobs is None else len(logprobs)} log-probs (return_logprob was set)"
            )
        if len(ids) > self.remaining:
            raise RuntimeError(f"the engine answered {len(ids)} tokens, more than the {self.remaining} asked for")
        self._append(ids, 1, [float(x) for x in logprobs])

    def add_tool(self, ids: list[int]) -> bool:
        """Append tool / template tokens (mask 0); False when the budget cut them short."""
        kept = list(ids[: max(self.remaining, 0)])
        self._append(kept, 0, [0.0] * len(kept))
        return len(kept) == len(ids)

    def _append(self, ids: list[int], mask: int, logprobs: list[float]) -> None:
        start = len(self.response_ids)
        self.response_ids += [int(i) for i in ids]
        self.mask += [mask] * len(ids)
        self.logprobs += logprobs
        self.pieces.append((start, len(self.response_ids), mask))

    def output(self, num_turns: int, **kwargs) -> AgentOutput:
        return AgentOutput(
            self.prompt_ids, list(self.response_ids), list(self.mask), list(self.logprobs), num_turns, **kwargs
        )


class EngineHandle:
    """One trajectory's engine: every turn goes to the same URL (its KV / radix cache holds the
    trajectory's prefix). Checks each answer like RolloutManager does (weight version, log-probs)."""

    def __init__(
        self,
        client: RolloutClient,
        params: dict,
        row: int,
        weight_version: str | None,
        seed: tuple[int, ...] | None = None,
    ):
        self.client, self.params, self.row = client, params, row
        self.weight_version, self.seed = weight_version, seed
        self.calls = 0
        self.versions: list[str | None] = []

    @property
    def url(self) -> str:
        return self.client.base_url

    async def generate(self, input_ids: list[int], max_new_tokens: int, **extra) -> GenerateOutput:
        from megarl.rollout.client.manager import StaleWeightsError, row_seed

        params = {**self.params, **extra, "n": 1, "max_new_tokens": int(max_new_tokens)}
        if self.seed is not None:  # trainer.deterministic: one seed per (row, turn)
            params["sampling_seed"] = row_seed((*self.seed, self.calls), self.row)
        out = (await self.client.agenerate([list(input_ids)], params, return_logprob=True))[0]
        self.calls += 1
        served = out.meta_info.get("weight_version")
        if self.weight_version is not None and served is not None and str(served) != self.weight_version:
            raise StaleWeightsError(
                f"row {self.row} turn {self.calls} was served with weight_version {served!r} by "
                f"{self.url}, but the engines were synced to {self.weight_version!r}"
            )
        if out.finish_reason.get("type") == "abort":
            raise RuntimeError(
                f"row {self.row} turn {self.calls} was aborted by {self.url}: {out.finish_reason.get('message')}"
            )
        self.versions.append(None if served is None else str(served))
        return out


@dataclass
class AgentSample:
    """One trajectory to run: row `index` of the rollout (prompt-major), its prompt, its engine."""

    index: int
    prompt_ids: list[int]
    engine: EngineHandle
    messages: list | None = None
    data_source: str | None = None
    ground_truth: str | None = None
    extra_info: dict | None = None


class AgentLoop:
    """Subclasses implement `run`; one instance serves every trajectory of a run, concurrently
    (keep per-trajectory state in `run`). `tokenizer`: the model's; `cfg`: rollout.agent;
    `max_response_tokens`: rollout.max_new_tokens."""

    def __init__(self, tokenizer, cfg, max_response_tokens: int):
        self.tokenizer, self.cfg, self.max_response_tokens = tokenizer, cfg, max_response_tokens

    async def run(self, sample: AgentSample) -> AgentOutput:
        raise NotImplementedError  # the interface: every registered loop implements it


AGENT_LOOPS: dict[str, Callable[..., AgentLoop]] = {}


def register_agent_loop(name: str):
    def wrap(cls):
        if name in AGENT_LOOPS:
            raise ValueError(f"an agent loop named {name!r} is already registered")
        AGENT_LOOPS[name] = cls
        declare_agent_loop(name)  # rollout.agent_loop may now name it
        return cls

    return wrap


@register_agent_loop("single_turn")
class SingleTurnLoop(AgentLoop):
    """One generate call: today's rollout as an agent loop (the reference the tool loop extends)."""

    async def run(self, sample: AgentSample) -> AgentOutput:
        traj = Trajectory(sample.prompt_ids, self.max_response_tokens)
        out = await sample.engine.generate(traj.context, traj.remaining)
        traj.add_model(out.output_ids, out.output_logprobs)
        return traj.output(
            1, text=out.text, finish_reason=out.finish_reason.get("type", ""), weight_version=sample.engine.versions[-1]
        )
