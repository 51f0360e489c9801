"""`megarl plot`: the image is written, and the figure's lines are the metrics the runs logged."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megarl.cli import main
from megarl.trainer.plot import legend_names, load_run, plot_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir, records, batch=4, n=8):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "config.yaml").write_text(f"data:\n  train_batch_size: {batch}\nrollout:\n  n: {n}\n")
    return run_dir


def records(rewards, step_s, val_at=(), entropy=True):
    out = []
    for i, (reward, seconds) in enumerate(zip(rewards, step_s)):
        r = {"step": i + 1, "reward/mean": reward, "response/length_mean": 10.0 + i, "perf/step_s": seconds}
        if entropy:
            r["actor/entropy"] = 2.0 - 0.25 * i
        if i + 1 in val_at:
            r["val/reward_mean"] = reward / 2
        out.append(r)
    return out


def panel(fig, title):
    found = [ax for ax in fig.axes if ax.get_title().startswith(title)]
    assert len(found) == 1, [ax.get_title() for ax in fig.axes]
    return found[0]


def test_one_run_writes_a_png_whose_lines_are_the_logged_metrics(tmp_path):
    from matplotlib.image import imread
    from PIL import Image

    run = write_run(tmp_path / "alpha", records([0.1, 0.4, 0.7], [2.0, 4.0, 8.0], val_at=(2, 3)))
    out = tmp_path / "curves.png"
    assert main(["plot", str(run), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    with Image.open(out) as image:
        assert image.mode == "P" and imread(out).shape[:2] == image.size[::-1]  # a decodable palette PNG

    fig = plot_runs([load_run(run)])
    reward = panel(fig, "reward").get_lines()[0]
    assert reward.get_xdata().tolist() == [1, 2, 3]
    assert reward.get_ydata().tolist() == [0.1, 0.4, 0.7]
    val = panel(fig, "validation reward").get_lines()[0]
    assert val.get_xdata().tolist() == [2, 3] and val.get_ydata().tolist() == [0.2, 0.35]
    assert panel(fig, "entropy").get_lines()[0].get_ydata().tolist() == [2.0, 1.75, 1.5]
    assert panel(fig, "step time").get_lines()[0].get_ydata().tolist() == [2.0, 4.0, 8.0]
    # 4 prompts x 8 samples = 32 rows a step, over each step's seconds
    assert panel(fig, "throughput").get_lines()[0].get_ydata().tolist() == [16.0, 8.0, 4.0]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["alpha"]


def test_two_runs_overlaid_with_a_legend_naming_both(tmp_path):
    a = write_run(tmp_path / "out_a" / "exp", records([0.1, 0.2, 0.3, 0.4], [1.0] * 4))
    b = write_run(tmp_path / "out_b" / "exp", records([0.5, 0.6, 0.7], [1.0] * 3, entropy=False), batch=2, n=4)
    out = tmp_path / "both.png"
    assert main(["plot", str(a), str(b / "metrics.jsonl"), "-o", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)

    names = legend_names([str(a), str(b / "metrics.jsonl")])
    assert names == ["out_a/exp", "out_b/exp"]  # one experiment name: told apart by their dirs
    fig = plot_runs([load_run(a, names[0]), load_run(b, names[1])])
    lines = panel(fig, "reward").get_lines()
    assert [line.get_label() for line in lines] == names
    assert lines[0].get_ydata().tolist() == [0.1, 0.2, 0.3, 0.4]
    assert lines[1].get_xdata().tolist() == [1, 2, 3] and lines[1].get_ydata().tolist() == [0.5, 0.6, 0.7]
    assert [line.get_label() for line in panel(fig, "entropy").get_lines()] == ["out_a/exp"]  # b has none
    assert [t.get_text() for t in fig.legends[0].get_texts()] == names

    by_samples = plot_runs([load_run(a, "a"), load_run(b, "b")], x="samples")
    a_line, b_line = panel(by_samples, "reward").get_lines()
    assert a_line.get_xdata().tolist() == [32, 64, 96, 128] and b_line.get_xdata().tolist() == [8, 16, 24]


def test_dynamic_sampling_counts_the_groups_generated(tmp_path):
    rows = records([0.1, 0.2], [1.0, 1.0])
    rows[0]["rollout/groups_generated"], rows[1]["rollout/groups_generated"] = 6.0, 9.0
    run = load_run(write_run(tmp_path / "dapo", rows, batch=4, n=8))
    assert run.samples.tolist() == [48, 120]


def test_a_metric_no_run_logged_has_no_panel(tmp_path):
    run = write_run(tmp_path / "r", records([0.1, 0.2], [1.0, 1.0], entropy=False))
    fig = plot_runs([load_run(run)])
    titles = sorted(ax.get_title() for ax in fig.axes)
    assert titles == ["response length (tokens)", "reward", "step time (s)", "throughput (samples/s)"]
    assert all(ax.get_lines() for ax in fig.axes)  # no empty panel left in the grid


def test_an_agent_run_gets_a_tool_call_success_panel(tmp_path):
    rows = records([0.1, 0.2], [1.0, 1.0])
    for r, rate in zip(rows, (0.4, 0.9)):
        r["rollout/tool_call_success_rate"] = rate
    fig = plot_runs([load_run(write_run(tmp_path / "r", rows))])
    assert panel(fig, "tool-call success rate").get_lines()[0].get_ydata().tolist() == [0.4, 0.9]


def test_the_kl_panel_names_the_kl_it_draws(tmp_path):
    rows = records([0.1, 0.2], [1.0, 1.0])
    for r, kl in zip(rows, (0.01, 0.03)):
        r["actor/ppo_kl"] = kl
    fig = plot_runs([load_run(write_run(tmp_path / "r", rows))])
    assert panel(fig, "KL").get_title() == "KL (actor/ppo_kl)"
    assert panel(fig, "KL").get_lines()[0].get_ydata().tolist() == [0.01, 0.03]


def test_a_line_cut_off_by_a_killed_run_is_left_out(tmp_path):
    run = write_run(tmp_path / "r", records([0.1, 0.2], [1.0, 1.0]))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')
    assert load_run(run).steps.tolist() == [1, 2]


@pytest.mark.parametrize(
    "case,needle",
    [
        ("no_metrics", "holds no metrics.jsonl"),
        ("missing", "no such run dir"),
        ("empty", "is empty"),
        ("bad_line", "metrics.jsonl line 2: not JSON"),
        ("no_step", "metrics.jsonl line 1: not a metrics record"),
        ("samples_without_config", "no config.yaml"),
        ("bad_format", "unknown image format"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_file(tmp_path, capsys, case, needle):
    run = tmp_path / "run"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    target, out, extra = run, tmp_path / "x.png", []
    if case == "missing":
        target = tmp_path / "nowhere"
    elif case == "empty":
        metrics.write_text("")
    elif case == "bad_line":
        metrics.write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": oops}\n')
    elif case == "no_step":
        metrics.write_text('{"reward/mean": 0.5}\n')
    elif case in ("samples_without_config", "bad_format"):
        metrics.write_text('{"step": 1, "reward/mean": 0.5}\n')
        extra = ["--x", "samples"] if case == "samples_without_config" else []
        out = tmp_path / "x.notaformat" if case == "bad_format" else out
    assert main(["plot", str(target), "-o", str(out), *extra]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megarl: plot: ") and needle in lines[0], captured.err
    assert str(out if case == "bad_format" else target) in lines[0]
    assert not out.exists()


def test_two_runs_keep_their_own_values_step_for_step(tmp_path):
    """Runs of different lengths: each line is its own run's, none shifted or truncated to the other."""
    a = load_run(write_run(tmp_path / "a", records(list(np.linspace(0, 1, 7)), [1.0] * 7)))
    b = load_run(write_run(tmp_path / "b", records([0.9, 0.8], [1.0] * 2)))
    lines = panel(plot_runs([a, b]), "response length").get_lines()
    assert lines[0].get_xdata().tolist() == list(range(1, 8)) and lines[1].get_xdata().tolist() == [1, 2]
    assert lines[0].get_ydata().tolist() == [10.0 + i for i in range(7)]
