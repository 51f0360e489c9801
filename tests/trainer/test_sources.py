"""The rollout sources (trainer/sources.py) against a scripted host, and the parity check of rows
that may come from older versions (parity.check_current_rows). No Ray, no ranks: the loop modes'
ordering and data positions, which the Ray-backed tests (test_async_loops.py) run through."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megarl.bridge.spec import BridgeSpec
from megarl.config.schema import BridgeConfig
from megarl.data.batch import Batch
from megarl.trainer.parity import ParityError, check_current_rows, version_number
from megarl.trainer.sources import SOURCES, FullyAsync, OneStepOff, OnPolicy, rollout_source


class Host:
    """next_prompts hands out batch numbers; rollout records (step, batch, weight version) and,
    for a step in `gates`, waits for the test to open that gate first."""

    def __init__(self, mode: str = "sync", total_steps: int = 3):
        self.cfg = SimpleNamespace(trainer=SimpleNamespace(mode=mode, total_steps=total_steps, pause_mode="retract"))
        self.weight_version, self.data_cursor, self.start_step = 0, 0, 0
        self.generated: list[tuple[int, int, int]] = []
        self.gates: dict[int, threading.Event] = {}
        self.started: dict[int, threading.Event] = {}  # set when a step's rollout has its prompts

    def next_prompts(self):
        batch = self.data_cursor
        self.data_cursor += 1
        return SimpleNamespace(batch=batch, meta={"metrics": {"data/batch": float(batch)}})

    def rollout(self, step, prompts, timing):
        self.started.setdefault(step, threading.Event()).set()
        if step in self.gates:
            self.gates[step].wait()
        self.generated.append((step, prompts.batch, self.weight_version))
        timing["perf/gen_s"] = 0.5
        return f"rows of batch {prompts.batch}", {"rollout/retries": 0.0}


def test_sync_generates_each_step_now_with_the_weights_it_trains():
    host = Host("sync")
    source = rollout_source(host)
    assert isinstance(source, OnPolicy) and not source.off_policy
    source.start()
    for step in (1, 2):
        timing: dict = {}
        rows, stats = source.rows(step, timing)
        assert rows == f"rows of batch {step - 1}" and stats["data/batch"] == step - 1 and timing["perf/gen_s"] == 0.5
        assert source.data_position() == step
        host.weight_version += 1  # the step trained and synced
    assert host.generated == [(1, 0, 0), (2, 1, 1)]
    spec = BridgeSpec(
        transport="distributed", server_urls=("http://127.0.0.1:1",), bucket_bytes=1, pause_generation=False
    )
    assert source.bridge_spec(spec) is spec


def test_one_step_off_generates_the_next_batch_while_a_step_trains_and_saves_the_trained_position():
    host = Host("one_step_off", total_steps=3)
    source = rollout_source(host)
    assert isinstance(source, OneStepOff) and source.off_policy
    host.gates[2] = threading.Event()
    source.start()
    try:
        timing: dict = {}
        rows, _ = source.rows(1, timing)  # batch 0 now (nothing overlapped step 1); batch 1 starts
        assert rows == "rows of batch 0" and "perf/gen_wait_s" in timing and timing["perf/gen_s"] == 0.5
        # step 2's prompts are drawn, its generation waits: step 1 trains meanwhile
        assert host.started.setdefault(2, threading.Event()).wait(timeout=30)
        assert host.data_cursor == 2 and source.data_position() == 1
        host.weight_version = 1  # step 1 trained; the engines still hold version 0
        release = threading.Timer(0.2, host.gates[2].set)
        release.start()
        sync_timing: dict = {}
        source.before_sync(sync_timing)  # the engines finish step 2's rollout before they sync
        assert [g[:2] for g in host.generated] == [(1, 0), (2, 1)]
        assert sync_timing["perf/gen_overlap_wait_s"] > 0
        rows, _ = source.rows(2, {})
        assert rows == "rows of batch 1" and source.data_position() == 2
        rows, _ = source.rows(3, {})  # the last step starts no further rollout
        assert rows == "rows of batch 2" and source.data_position() == 3 and host.data_cursor == 3
    finally:
        host.gates[2].set()  # a failed assertion must not leave the rollout thread waiting
        source.stop()
    assert [g[:2] for g in host.generated] == [(1, 0), (2, 1), (3, 2)]


def test_one_step_off_stops_with_a_rollout_in_flight():
    host = Host("one_step_off", total_steps=5)
    source = rollout_source(host)
    host.gates[2] = threading.Event()
    source.start()
    source.rows(1, {})
    host.gates[2].set()
    source.stop()  # cancels step 2's rollout or waits for it: no rollout thread outlives fit()
    assert not [t for t in threading.enumerate() if t.name.startswith("one-step-off-rollout")]
    assert [g[0] for g in host.generated] in ([1], [1, 2])
    assert source.data_position() == 1  # the batch generated ahead was never trained


def test_fully_async_pauses_generation_around_the_sync():
    host = Host("fully_async")
    source = rollout_source(host)
    assert isinstance(source, FullyAsync) and source.off_policy
    spec = source.bridge_spec(
        BridgeSpec(transport="distributed", server_urls=("http://127.0.0.1:1",), bucket_bytes=1, pause_generation=False)
    )
    assert spec.pause_generation and spec.pause_mode == "retract"
    assert set(SOURCES) == {"sync", "one_step_off", "fully_async"}


def _rows(versions, starts=None, off_rows=()):
    n = len(versions)
    old = torch.zeros(n, 3)
    rollout = old.clone()
    for r in off_rows:
        rollout[r, 1] = 0.3  # an update's worth of difference
    non_tensors = {"rollout_weight_version": np.array(versions, dtype=object)}
    if starts is not None:
        non_tensors["rollout_start_version"] = np.array(starts, dtype=object)
    return Batch(
        {
            "old_log_probs": old,
            "rollout_log_probs": rollout,
            "response_mask": torch.ones(n, 3),
            "prompt_lengths": torch.full((n,), 4),
        },
        non_tensors=non_tensors,
    )


BRIDGE = BridgeConfig(parity_atol=1e-3, parity_rows_off=0.0, check_parity=True)


def test_rows_all_served_by_the_trainers_version_are_checked():
    with pytest.raises(ParityError, match="weight version 2"):
        check_current_rows(_rows(["2", "2"], off_rows=[0]), 5, BRIDGE, 2, lambda: [])
    metrics = check_current_rows(_rows(["2", "2"]), 5, BRIDGE, 2, lambda: [])
    assert metrics["async/staleness_max"] == 0 and metrics["rollout/logprob_diff_max"] == 0


def test_rows_from_an_older_version_are_measured_not_checked():
    """A row one version behind differs by design: logged, with the staleness; the same holds for
    a row that started under an older version and finished under the current one."""
    metrics = check_current_rows(_rows(["1", "2"], off_rows=[0]), 5, BRIDGE, 2, lambda: [])
    assert metrics["async/staleness_max"] == 1 and metrics["async/staleness_mean"] == 0.5
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(0.3)
    spanning = _rows(["2", "2"], starts=["1", "2"], off_rows=[0])
    assert check_current_rows(spanning, 5, BRIDGE, 2, lambda: [])["async/staleness_max"] == 1
    assert version_number("default") == 0 and version_number("7") == 7 and version_number("x") is None
