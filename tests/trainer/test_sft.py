"""`megarl sft` as a user runs it: the example config learns, a stopped and resumed run is the
uninterrupted run bit for bit, the exports load in transformers with the run's own val loss, and
bad input is refused with one line before any process starts.

The runs are real `megarl sft` processes (Ray, two Megatron ranks with EP=2 / DP=2) on
configs/sft-quickstart.yaml: 40 steps over 32 tool-calling transcripts, val loss every 10 steps.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests._procs import ROOT, _assert_nothing_left, _start, _wait_for_line, assert_runs_identical

CONFIG = "configs/sft-quickstart.yaml"
STEPS = 40


def _finish(proc: subprocess.Popen, timeout_s: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out[-4000:]
    return out


def _metrics(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The example config uninterrupted; and the same run stopped by SIGTERM after step 20 (it
    finishes its step, saves and exits 0), then continued with trainer.resume=auto."""
    root = tmp_path_factory.mktemp("sft")
    background = ThreadPoolExecutor(1)  # the uninterrupted run beside the interrupted one
    whole_run = background.submit(
        lambda: _finish(_start(["sft", CONFIG, f"trainer.output_dir={root}/whole"], uuid.uuid4().hex))
    )
    run_id = uuid.uuid4().hex
    proc = _start(["sft", CONFIG, f"trainer.output_dir={root}/cut"], run_id)
    before = _wait_for_line(proc, f"step 20/{STEPS}", timeout_s=300)
    proc.send_signal(signal.SIGTERM)
    stopped = before + _finish(proc)
    _assert_nothing_left(run_id)
    resumed = _finish(_start(["sft", CONFIG, f"trainer.output_dir={root}/cut"], uuid.uuid4().hex))
    whole = whole_run.result()
    background.shutdown()
    return {
        "whole": root / "whole" / "sft-quickstart",
        "cut": root / "cut" / "sft-quickstart",
        "whole_out": whole,
        "stopped_out": stopped,
        "resumed_out": resumed,
    }


def test_the_sft_loss_falls_on_the_example_config(runs):
    m = _metrics(runs["whole"])
    assert sorted(m) == list(range(1, STEPS + 1))
    first, last = (sum(m[s]["sft/loss"] for s in steps) / 5 for steps in (range(1, 6), range(STEPS - 4, STEPS + 1)))
    assert first > 3.0 and last < 0.25 * first, (first, last)  # a random 128-token model learns the transcripts
    assert m[STEPS]["val/sft/loss"] < 0.3 * m[10]["val/sft/loss"]  # and the held-out ones
    assert [s for s in m if "val/sft/loss" in m[s]] == [10, 20, 30, 40]
    for key in ("sft/loss_tokens", "sft/tokens", "perf/tokens_per_s", "perf/step_s", "actor/grad_norm"):
        assert m[1][key] > 0, key
    out = runs["whole_out"]
    assert "sft run dir" in out and "32 train conversations" in out and "40 steps" in out
    line = next(x for x in out.splitlines() if x.startswith(f"step {STEPS}/{STEPS} | loss "))
    assert "val_loss" in line and "tok/s" in line and "s/step" in line
    assert "sft loss: first 10 steps mean" in out
    assert (runs["whole"] / "tensorboard").is_dir() and (runs["whole"] / "summary.json").is_file()


def test_a_stopped_and_resumed_run_equals_the_uninterrupted_one_bit_for_bit(runs):
    """Stopped by SIGTERM after step k >= 20, resumed from that checkpoint: every metric but the
    wall clocks identical at every step (float for float), and the exported weights equal."""
    stop_line = [x for x in runs["stopped_out"].splitlines() if "stopped by SIGTERM" in x]
    assert stop_line and f"/{STEPS}; checkpoint" in stop_line[0], runs["stopped_out"][-2000:]
    k = int(stop_line[0].split("after step ")[1].split("/")[0])
    assert 20 <= k < STEPS and f"resumed from {runs['cut']}/checkpoints/step_{k:06d}" in runs["resumed_out"]
    assert_runs_identical(runs["whole"], runs["cut"], STEPS)
    whole, cut = _tensors(runs["whole"] / "hf"), _tensors(runs["cut"] / "hf")
    assert whole.keys() == cut.keys() and all(torch.equal(whole[k], cut[k]) for k in whole)
    initial = _tensors(runs["whole"] / "init_model")  # the comparison is not vacuous: SFT moved them
    assert sum(not torch.equal(initial[k], whole[k]) for k in whole) > len(whole) // 2


def test_megarl_export_of_an_sft_checkpoint_loads_with_the_runs_val_loss(runs, tmp_path):
    """`megarl export` of the last checkpoint equals the end-of-run export; transformers, in
    float64 on that folder, gives the val loss the run logged (fp32 engine): 1e-5 absolute."""
    out = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "export", str(runs["whole"]), "--out", str(tmp_path / "hf")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    mine, final = _tensors(tmp_path / "hf"), _tensors(runs["whole"] / "hf")
    assert mine.keys() == final.keys() and all(torch.equal(mine[k], final[k]) for k in final)
    logged = _metrics(runs["whole"])[STEPS]["val/sft/loss"]
    assert _hf_val_loss(tmp_path / "hf") == pytest.approx(logged, abs=1e-5)


def _hf_val_loss(model_dir: Path) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.data.dataset import read_rows
    from megarl.data.sft import tokenize_chat

    tok = AutoTokenizer.from_pretrained(model_dir)  # the export's own tokenizer and template
    model = AutoModelForCausalLM.from_pretrained(model_dir).double().eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for row in read_rows(ROOT / "configs/data/sft-arith-tool-val.jsonl"):
            ids, mask = tokenize_chat(tok, row["messages"])
            labels = torch.tensor([i if m else -100 for i, m in zip(ids, mask)])
            logits = model(torch.tensor([ids])).logits[0]
            total += float(torch.nn.functional.cross_entropy(logits[:-1], labels[1:], reduction="sum"))
            tokens += sum(mask)
    return total / tokens


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


# ------------------------------------------------------------------ bad input: exit 2, nothing started
def _refused(args: list[str], tmp_path: Path) -> str:
    """Run `megarl sft`; it must exit 2 with one line, quickly, leaving no process."""
    run_id, start = uuid.uuid4().hex, time.time()
    proc = _start(["sft", CONFIG, f"trainer.output_dir={tmp_path}/out", *args], run_id)
    out, _ = proc.communicate(timeout=120)
    lines = [x for x in out.strip().splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1, out
    assert time.time() - start < 60  # refused up front: no Ray, no rank was started
    _assert_nothing_left(run_id, within_s=1)
    assert not (tmp_path / "out").exists()  # not even a run dir
    return lines[0]


def test_a_row_without_an_assistant_turn_is_refused_naming_file_row_and_field(tmp_path):
    rows = [json.loads(x) for x in (ROOT / "configs/data/sft-arith-tool-train.jsonl").read_text().splitlines()]
    rows[5]["messages"] = rows[5]["messages"][:1]  # the question only
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = _refused([f"sft.train_files={path}"], tmp_path)
    assert line == f"megarl: data error: {path} row 5: field 'messages' has no assistant turn, so nothing to train on"


def test_a_malformed_message_list_in_parquet_is_refused_naming_file_row_and_field(tmp_path):
    from megarl.data.tasks import make_arith_tool_chats, write_rows

    rows = make_arith_tool_chats(12)
    rows[7]["messages"][3]["role"] = "robot"
    path = write_rows(rows, tmp_path / "chats.parquet")
    line = _refused([f"sft.val_files={path}"], tmp_path)
    assert line.startswith(f"megarl: data error: {path} row 7: field 'messages[3].role' is 'robot', expected one of")


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
    from megarl.models.tiny import build_tiny_checkpoint

    model = build_tiny_checkpoint(tmp_path / "plain", seed=0, preset="tiny-qwen3-moe-tools")
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        path = model / name
        if name.endswith(".json"):
            config = json.loads(path.read_text())
            config.pop("chat_template", None)
            path.write_text(json.dumps(config))
        else:
            path.unlink(missing_ok=True)
    line = _refused([f"model.path={model}"], tmp_path)
    assert line.startswith(f"megarl: data error: model.path={model}: the tokenizer has no chat template")


def test_a_bad_sft_key_is_refused_naming_it(tmp_path):
    line = _refused(["sft.batch_size=3"], tmp_path)  # data parallel 2 cannot split 3 rows
    assert line.startswith("megarl: config error: sft.batch_size=3 must be divisible by the data-parallel size 2")
