"""A killed worker's torch shared-memory files are removed once it has exited, a running one's kept."""

from __future__ import annotations

import os
import subprocess
import sys

from megarl.controller.shm_leftovers import remove_torch_shm_files


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
        [f"torch_{mine}_1_1", f"torch_{mine}_2_1", f"torch_{child.pid}0_1_1"])
