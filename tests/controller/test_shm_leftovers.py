"""A killed worker's torch shared-memory files are removed once it has exited, a running one's kept."""

from __future__ import annotations

import os
import subprocess
import sys

from megarl.controller.shm_leftovers import record_ranks, remove_recorded_leftovers, remove_torch_shm_files


def test_files_of_exited_processes_go_and_those_of_running_ones_stay(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    mine = os.getpid()
    for pid in (child.pid, mine):
        for k in (1, 2):
            (tmp_path / f"torch_{pid}_{k}_1").write_bytes(b"x")
    (tmp_path / f"torch_{child.pid}0_1_1").write_bytes(b"x")  # another pid with the same prefix
    child.kill()
    removed = remove_torch_shm_files([child.pid, mine], timeout_s=0.5, shm_dir=str(tmp_path))
    child.wait()
    assert removed == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"torch_{mine}_1_1", f"torch_{mine}_2_1", f"torch_{child.pid}0_1_1"]
    )


def test_a_later_run_in_the_run_dir_removes_what_its_killed_ranks_left(tmp_path):
    """A driver killed outright never shuts its ranks down: the next run in the same run directory
    removes the files of the ranks recorded there whose pid no longer exists, and names the
    recorded ranks still running (recorded again, swept at that run's end)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = os.getpid()
    for pid in (dead.pid, mine, 4_000_000):  # 4_000_000: a pid of another pid namespace, not recorded
        (shm / f"torch_{pid}_7_1").write_bytes(b"x")
    record = tmp_path / "ranks.json"
    record_ranks(
        record,
        [{"pid": dead.pid, "node": "10.0.0.1"}, {"pid": 12345, "node": "10.0.0.2"}],
        node="10.0.0.1",
        also=[mine],
    )
    assert remove_recorded_leftovers(record, node="10.0.0.2", shm_dir=str(shm)) == []  # another machine's
    assert len(list(shm.iterdir())) == 3
    assert remove_recorded_leftovers(record, node="10.0.0.1", shm_dir=str(shm)) == [mine]
    assert sorted(p.name for p in shm.iterdir()) == sorted([f"torch_{4_000_000}_7_1", f"torch_{mine}_7_1"])
    assert remove_recorded_leftovers(tmp_path / "none.json", node="10.0.0.1", shm_dir=str(shm)) == []
