"""Procedural, verifiable tasks: datasets megarl can generate instead of downloading.

`digits`: the prompt is a string of random digits ("382") and the answer is its last digit
("2"). Small enough that the tiny randomly initialised Qwen3-MoE learns it from scratch with
GRPO on a CPU in ~100-200 steps, yet the answer depends on the prompt: answering with one
fixed digit scores 0.1 on average, so a rising reward proves the policy reads the prompt.
Scored by megarl.reward.rule under data_source "megarl/digits".

`arith`: "What is 23 + 58? Answer with the number only." -> "81", two-digit addition and
subtraction for a pretrained instruct model (SmolLM2); the reward is 1 when the last integer in
the response is the answer (data_source "megarl/arith"), so a worked solution ending in the result
scores too. The instruction keeps answers short: without it SmolLM2-135M explains at length and
scores 3% (sampled at temperature 1 from 8 prompts x 4), with it 6%.

`add20`: "What is 13 + 7? Answer with the number only.", sums of two integers in 0..20, scored as
arith. The question space is finite (441 sums), so a fifth of it is held out: validation rows
(split "val") are the held-out sums, each at most once while there are enough (89), and training rows
never are. SmolLM2-135M-Instruct answers 39% of the held-out ones greedily.

`arith_tool`: "What is 347 * 29?", for the agent loop (rollout.agent_loop: tool,
configs/agent-arith-tool.yaml); scored as arith, plus 0.1 for a wrong integer (data_source
"megarl/arith_tool"). Its transcripts solved with one python call (make_arith_tool_chats, the chat
task of the same name: sft.task) are the agent's SFT cold start.

`shapes`: "<image>colour?" about a generated image, for vision-language models (visual_task.py).

`rg:<name>`: any reasoning-gym dataset (rg:basic_arithmetic, rg:chain_sum, rg:countdown, ...),
generated with its default configuration; its rows and its scorer (data_source
"reasoning_gym/<name>") are megarl.data.reasoning_gym_task.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from megarl.data.reasoning_gym_task import TASK_PREFIX as REASONING_GYM_PREFIX
from megarl.data.reasoning_gym_task import make_reasoning_gym_rows
from megarl.data.visual_task import make_shapes_rows

DIGITS_DATA_SOURCE = "megarl/digits"
DIGITS_LENGTH = 3


def digits_answer(digits: str) -> str:
    """The ground truth of a digits prompt: its last digit."""
    return digits[-1]


def make_digits_rows(num: int, seed: int = 0, length: int = DIGITS_LENGTH) -> list[dict]:
    """`num` canonical dataset rows of the digits task, deterministic in `seed`."""
    if num < 0 or length < 1:
        raise ValueError(f"make_digits_rows needs num >= 0 and length >= 1, got {num}, {length}")
    rng = random.Random(seed)
    rows = []
    for index in range(num):
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        rows.append(
            {
                "prompt": [{"role": "user", "content": digits}],
                "data_source": DIGITS_DATA_SOURCE,
                "reward_model": {"ground_truth": digits_answer(digits), "style": "rule"},
                "extra_info": {"index": index, "digits": digits, "rule": "last_digit"},
            }
        )
    return rows


ARITH_DATA_SOURCE = "megarl/arith"
ARITH_INSTRUCTION = "Answer with the number only."


def make_arith_rows(num: int, seed: int = 0) -> list[dict]:
    """`num` rows of two-operand integer arithmetic ("What is 23 + 58? ..."), deterministic in `seed`."""
    if num < 0:
        raise ValueError(f"make_arith_rows needs num >= 0, got {num}")
    rng = random.Random(seed)
    rows = []
    for index in range(num):
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
        answer = a + b if op == "+" else a - b
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What is {a} {op} {b}? {ARITH_INSTRUCTION}"}],
                "data_source": ARITH_DATA_SOURCE,
                "reward_model": {"ground_truth": str(answer), "style": "rule"},
                "extra_info": {"index": index, "a": a, "b": b, "op": op},
            }
        )
    return rows


ADD20_MAX = 20


def _add20_held_out(a: int, b: int) -> bool:
    """The validation fifth of add20's sums (a fixed rule, so every seed holds out the same ones)."""
    return (7 * a + 3 * b) % 5 == 0


def make_add20_rows(num: int, seed: int = 0, split: str = "train") -> list[dict]:
    """`num` rows of "What is a + b?" with a, b in 0..20: training draws (with replacement) from the
    sums not held out; validation takes the held-out sums in a seeded order (cycling past 89)."""
    if num < 0 or split not in ("train", "val"):
        raise ValueError(f"make_add20_rows needs num >= 0 and split train|val, got {num}, {split!r}")
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(ADD20_MAX + 1) for b in range(ADD20_MAX + 1)]
    pool = [ab for ab in pairs if _add20_held_out(*ab) == (split == "val")]
    if split == "val":
        rng.shuffle(pool)
        chosen = [pool[k % len(pool)] for k in range(num)]
    else:
        chosen = [rng.choice(pool) for _ in range(num)]
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {a} + {b}? {ARITH_INSTRUCTION}"}],
            "data_source": ARITH_DATA_SOURCE,
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {"index": index, "a": a, "b": b, "op": "+", "split": split},
        }
        for index, (a, b) in enumerate(chosen)
    ]


ARITH_TOOL_DATA_SOURCE = "megarl/arith_tool"


def make_arith_tool_rows(num: int, seed: int = 0) -> list[dict]:
    """`num` rows of "What is 347 * 29?" (3-digit by 2-digit products) for a model that calls the
    python tool (rollout.agent_loop: tool) after an SFT cold start on make_arith_tool_chats.
    Products only: a small model cannot compute them, so the reward comes from a correct call and
    copying its answer; with sums mixed in, whose leading digits are the first operand's, a tiny
    model learns to copy those from the question instead of reading the tool's answer, and learns
    to read it several times later. The prompt is the question alone, for the same reason: a
    system message with an example call puts digits next to the question's that compete with them.
    Scored by megarl/arith_tool: arith's rule on the model's last turn, with 0.1 for a wrong
    integer (reward/rule.py)."""
    if num < 0:
        raise ValueError(f"make_arith_tool_rows needs num >= 0, got {num}")
    rng = random.Random(seed)
    rows = []
    for index in range(num):
        a, b, op = rng.randint(100, 999), rng.randint(10, 99), "*"
        answer = a * b
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What is {a} {op} {b}?"}],
                "data_source": ARITH_TOOL_DATA_SOURCE,
                "reward_model": {"ground_truth": str(answer), "style": "rule"},
                "extra_info": {"index": index, "a": a, "b": b, "op": op, "tool": "python"},
            }
        )
    return rows


def arith_tool_call(row: dict) -> str:
    """The python call that solves an arith_tool row: the question's expression, verbatim."""
    x = row["extra_info"]
    code = f"print({x['a']} {x['op']} {x['b']})"
    return f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"


def make_arith_tool_chats(num: int, seed: int = 0) -> list[dict]:
    """`num` chat rows {"messages": [...]} of arith_tool's prompts (the same questions for the same
    seed) solved with one python call: the question, the call, the tool's answer as the sandbox
    prints it (the exact result and a newline), the number. The transcripts of the agent's SFT
    cold start (sft.task: arith_tool; configs/data/sft-arith-tool-*.jsonl)."""
    rows = []
    for row in make_arith_tool_rows(num, seed):
        answer = row["reward_model"]["ground_truth"]
        turns = [
            {"role": "assistant", "content": arith_tool_call(row)},
            {"role": "tool", "content": f"{answer}\n"},
            {"role": "assistant", "content": answer},
        ]
        rows.append({"messages": row["prompt"] + turns})
    return rows


TASKS: dict[str, Callable[..., list[dict]]] = {
    "digits": make_digits_rows,
    "arith": make_arith_rows,
    "arith_tool": make_arith_tool_rows,
    "add20": make_add20_rows,
    "shapes": make_shapes_rows,  # rows with images (visual_task.py)
}
CHAT_TASKS: dict[str, Callable[..., list[dict]]] = {"arith_tool": make_arith_tool_chats}  # sft.task
SPLIT_TASKS = {"add20"}  # finite question spaces: their validation questions are held out of training


def generate_task(name: str, num: int, seed: int = 0, split: str = "train") -> list[dict]:
    """Rows of the procedural task `name`: a key of TASKS, or rg:<reasoning-gym dataset>. `split`
    ("train" or "val") matters to SPLIT_TASKS only; the others differ by seed."""

    if name.startswith(REASONING_GYM_PREFIX):
        return make_reasoning_gym_rows(name[len(REASONING_GYM_PREFIX) :], num, seed)
    if name not in TASKS:
        raise ValueError(
            f"unknown procedural task {name!r}; known tasks: {sorted(TASKS)} and rg:<reasoning-gym dataset>"
        )
    return TASKS[name](num, seed, split=split) if name in SPLIT_TASKS else TASKS[name](num, seed)


def generate_chats(name: str, num: int, seed: int = 0) -> list[dict]:
    """Chat rows {"messages": [...]} of the procedural SFT task `name` (a key of CHAT_TASKS)."""
    if name not in CHAT_TASKS:
        raise ValueError(f"unknown chat task {name!r}; known: {sorted(CHAT_TASKS)}")
    return CHAT_TASKS[name](num, seed)


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write canonical rows to .parquet (pyarrow) or .jsonl, chosen by the file suffix."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out)
    elif out.suffix == ".jsonl":
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        raise ValueError(f"cannot write rows to {out}: use a .parquet or .jsonl file name")
    return out


def write_task(name: str, num: int, seed: int, path: str | Path, split: str = "train") -> Path:
    """Generate the procedural task `name` and write it to `path`."""
    return write_rows(generate_task(name, num, seed, split), path)
