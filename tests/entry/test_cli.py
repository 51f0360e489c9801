"""The `megarl` command as a user runs it: errors, exit codes, and no process left behind.

Every process a run starts (Ray's raylet, GCS and workers, the rollout server, Megatron ranks)
inherits the environment, so a unique marker variable finds them all, also orphans (tests/_procs.py).
Crashes (a SIGKILL'd driver, a dead rank) are in test_crash.py; SIGTERM and Ctrl-C (once: save and
stop; twice: stop at once) in tests/trainer/test_preemption_runs.py.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from tests._procs import SMALL_RUN, _assert_nothing_left, _start


@pytest.mark.parametrize(
    "override,key",
    [
        ("actor.parallel.tp=3", "actor.parallel"),
        ("actor.optim.lr=-1", "actor.optim.lr"),
        ("rollout.top_p=2", "rollout.top_p"),
        ("actor.parallel.ep=3", "actor.parallel.ep"),
        ("trainer.no_such_key=1", "trainer.no_such_key"),
        ("rollout.backend=sglang", "rollout.backend"),
        ("trainer.mode=fully_async", "trainer.mode"),  # the quickstart is colocated
        ("actor.offload.host_optimizer=1.0", "actor.offload.host_optimizer"),  # the quickstart is fp32
    ],
)
def test_bad_config_exits_2_with_one_line_naming_the_key(override, key):
    run_id = uuid.uuid4().hex
    start = time.time()
    proc = _start(["train", "configs/quickstart.yaml", override], run_id)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    lines = [x for x in out.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and key in lines[0], out
    assert time.time() - start < 30  # rejected up front: no Ray, no server was started
    _assert_nothing_left(run_id, within_s=1)


def test_plot_of_a_dir_without_metrics_exits_2_naming_it_and_draws_a_run(tmp_path):
    (tmp_path / "not_a_run").mkdir()
    proc = _start(["plot", str(tmp_path / "not_a_run"), "-o", str(tmp_path / "x.png")], uuid.uuid4().hex)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert out.strip().splitlines() == [
        f"megarl: plot: {tmp_path / 'not_a_run'} holds no metrics.jsonl (a run dir is "
        "trainer.output_dir/trainer.experiment_name)"
    ]
    assert not (tmp_path / "x.png").exists()
    proc = _start(["plot", "benchmarks/reference_curves/quickstart.jsonl", "-o", str(tmp_path / "q.png")], "plot")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and (tmp_path / "q.png").read_bytes().startswith(b"\x89PNG"), out


def test_dataset_row_missing_a_field_is_reported_with_row_and_field(tmp_path):
    from megarl.data.tasks import make_digits_rows, write_rows

    rows = make_digits_rows(40, seed=0)
    del rows[17]["reward_model"]["ground_truth"]
    path = write_rows(rows, tmp_path / "bad.parquet")
    run_id = uuid.uuid4().hex
    proc = _start(
        ["train", "configs/quickstart.yaml", f"data.train_files={path}", f"trainer.output_dir={tmp_path}/out"], run_id
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "row 17" in out and "ground_truth" in out, out
    _assert_nothing_left(run_id)


def test_error_mid_run_stops_every_process_and_reports_it(tmp_path):
    # A reward function that raises on its second call: the loop fails inside step 2.
    module = tmp_path / "flaky_reward.py"
    state = tmp_path / "calls.json"
    module.write_text(
        "import json, pathlib\n"
        f"STATE = pathlib.Path({str(state)!r})\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    n = json.loads(STATE.read_text()) if STATE.exists() else 0\n"
        "    STATE.write_text(json.dumps(n + 1))\n"
        "    if n >= 16 * 4:\n"
        "        raise RuntimeError('flaky reward failed on purpose')\n"
        "    return 0.0\n"
    )
    run_id = uuid.uuid4().hex
    proc = _start(
        [
            "train",
            "configs/quickstart.yaml",
            f"trainer.output_dir={tmp_path}/out",
            f"reward.custom_function={module}:score",
            *SMALL_RUN,
        ],
        run_id,
    )
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-3000:]
    # one line for people: what failed, what to do, where the traceback went (not the terminal)
    last = out.strip().splitlines()[-1]
    # the reward's failure names the row and its data_source (megarl/reward/rule.py RewardError)
    assert last.startswith("megarl: run failed: RewardError: row "), last
    assert "data_source 'megarl/digits'" in last and "raised RuntimeError: flaky reward failed on purpose" in last
    assert "no checkpoint was saved" in last and "train.log" in last and "--debug" in last
    assert "Traceback" not in out
    log = (tmp_path / "out" / "quickstart" / "train.log").read_text()
    assert "Traceback" in log and "flaky reward failed on purpose" in log and "step 1/1000" in log
    assert json.loads(state.read_text()) > 16 * 4
    _assert_nothing_left(run_id)


def test_debug_puts_the_traceback_on_the_terminal_too(tmp_path, capsys):
    from megarl.cli import _report_failure

    try:
        raise ValueError("broken on purpose\nsecond line")
    except ValueError as err:
        assert _report_failure(err, tmp_path, debug=True) == 1
    err_text = capsys.readouterr().err
    assert "Traceback" in err_text and "broken on purpose" in err_text
    assert err_text.strip().splitlines()[-1].startswith("megarl: run failed: ValueError: broken on purpose |")
    assert "Traceback" in (tmp_path / "train.log").read_text()
