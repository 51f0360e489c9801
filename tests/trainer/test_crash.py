"""Crashes of a run, as a user meets them: a SIGKILL'd driver, a killed Ray actor, a dead rank.

Whatever dies, nothing the run started may keep running (and holding ports, memory or GPUs):
the driver's SIGKILL runs no cleanup, so its children die by parent-death signals
(megarl/procs/lifeline.py, Ray's own for gcs_server and raylet) and a Reaper
(megarl/procs/reaper.py) for Ray's agents. A dead trainer rank stops the run at once with one
line naming it (tests/trainer/test_durability.py). The time limits: 30 s to a clean host, 60 s to a stopped run.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import time
import uuid

import httpx
import psutil
import torch

from tests._procs import SMALL_RUN, _marked, _start, _tree, _wait_for_line, _wait_until_none_left

torch.set_num_threads(1)


def _describe(process: psutil.Process) -> str:
    """The name, or the command line of a python process ("" for one that just exited)."""
    try:
        name = process.name()
        return " ".join(process.cmdline()) if name.startswith("python") else name
    except psutil.Error:
        return ""


def test_driver_sigkill_leaves_no_process_of_the_run(tmp_path):
    """TP followers and the router too: every kind of process a run starts is up when it dies."""
    run_id = uuid.uuid4().hex
    proc = _start(
        [
            "train",
            "configs/quickstart.yaml",
            f"trainer.output_dir={tmp_path}",
            *SMALL_RUN,
            "rollout.tp=2",
            "rollout.router=true",
        ],
        run_id,
    )
    _wait_for_line(proc, "step 2/", timeout_s=240)
    tree = _tree(proc.pid)  # Ray's agents overwrite their environment: the marker misses them
    names = {_describe(p) for p in tree}
    assert {
        "raylet",
        "gcs_server",
        "ray::MegatronActor",
        "ray::EngineLauncher",
        "sglang::router",
        "ray::DashboardAgent",
    } <= names, names
    assert sum("multiprocessing.spawn" in name for name in names) == 1  # the TP follower
    # the ranks' torch shared-memory files (the bridge's bucket buffers) exist while they run
    from megarl.controller.shm_leftovers import SHM_DIR, remove_recorded_leftovers

    record = tmp_path / "quickstart" / "ranks.json"
    pids = json.loads(record.read_text())["pids"]
    left = lambda: [f for pid in pids for f in glob.glob(f"{SHM_DIR}/torch_{pid}_*")]  # noqa: E731
    assert len(pids) == 2 and left(), "the ranks hold no shared-memory file: the record names the wrong pids"
    os.kill(proc.pid, signal.SIGKILL)  # the driver only, not its group: nothing else is signalled
    proc.wait(timeout=10)
    gone_s = _wait_until_none_left(run_id, within_s=30, also=tree)
    print(f"driver SIGKILL -> nothing left {gone_s:.1f}s")
    # A rank's files outlive it when its torch_shm_manager dies with it (Ray ends a dead driver's
    # workers); a manager that outlives its rank unlinks them itself: which one happens is a race.
    # Either way a next run in this run directory leaves none (shm_leftovers.py; the removal
    # itself is tested on files made to stay in tests/controller/test_shm_leftovers.py).
    stayed = left()
    assert remove_recorded_leftovers(record, json.loads(record.read_text())["node"]) == []
    assert left() == []
    print(f"shared-memory files left by the killed ranks and removed: {len(stayed)}")


def test_killed_launcher_actor_takes_its_server_and_tp_followers_down(tiny_model_path, tmp_path):
    """An actor's subprocesses follow it however it dies (OOM kill, a reclaimed job's actor on an
    external cluster): before lifeline.py a SIGKILL'd launcher left its server serving."""
    import ray

    from megarl.controller.cluster import RayCluster
    from megarl.rollout.fleet.engine_launcher import EngineLauncher, EngineNodeSpec

    spec = EngineNodeSpec(
        backend="embedded", model_path=str(tiny_model_path), engine=0, tp=2, log_path=str(tmp_path / "server.log")
    )
    with RayCluster(num_cpus=1, log_to_driver=False):
        launcher = ray.remote(EngineLauncher).options(num_cpus=0).remote(spec)
        ray.get(launcher.start.remote())
        server = psutil.Process(ray.get(launcher.server_pid.remote()))
        tree = [server, *server.children(recursive=True)]
        assert any("multiprocessing.spawn" in _describe(p) for p in tree)  # the TP follower
        os.kill(server.ppid(), signal.SIGKILL)  # the launcher actor's process
        marker = uuid.uuid4().hex  # no process carries it: only the tree is watched
        _wait_until_none_left(marker, within_s=30, also=tree)


# A dead trainer rank (SIGKILL mid-run -> one line naming it and the last checkpoint -> resume) is
# tested where the checkpoints are: tests/trainer/test_durability.py. Here: one dying while nobody calls it.
def test_a_rank_dying_during_generation_stops_the_run_without_waiting_for_it(tmp_path):
    """Generation calls no rank; the trainer's RankWatch finds the death within seconds, aborts
    the engines' requests and stops the run (long rollouts would otherwise hide it for minutes).
    8 rows at a time, up to 240 tokens each, for 1024 rows: generation lasts far longer than this."""
    run_id = uuid.uuid4().hex
    proc = _start(
        [
            "train",
            "configs/quickstart.yaml",
            f"trainer.output_dir={tmp_path}",
            "data.num_train=64",
            "rollout.n=64",
            "rollout.max_new_tokens=240",
            "rollout.max_batch_size=8",
            "trainer.val_every=0",
            "trainer.loggers=[console,jsonl]",
        ],
        run_id,
    )
    header = _wait_for_line(proc, "megarl: run dir", timeout_s=240)
    url = re.search(r"rollout engines \['(http://[^']+)'\]", header).group(1)
    marked = _marked(run_id)
    [rank1] = [p for p in marked if p.environ().get("MEGARL_WORKER") == "actor/1" and p.name().startswith("ray::")]
    [key] = {p.environ().get("MEGARL_ROLLOUT_API_KEY") for p in marked} - {None}
    deadline = time.monotonic() + 120  # the first step's generation is under way: kill then
    while (
        httpx.get(f"{url}/get_server_info", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()[
            "pending_requests"
        ]
        == 0
    ):
        assert time.monotonic() < deadline, "generation never started"
        time.sleep(0.05)
    tree = _tree(proc.pid)
    os.kill(rank1.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    last = [line for line in out.splitlines() if line.strip()][-1]
    assert proc.returncode == 1 and "step 1/" not in out, out[-3000:]
    assert last.startswith(f"megarl: actor rank 1 (pid {rank1.pid}, node ") and "died during check_alive()" in last
    _wait_until_none_left(run_id, within_s=30, also=tree)


# ---- the two mechanisms alone, in plain processes (no Ray) ------------------------------------------

_PARENT = """
import subprocess, sys
from megarl.procs.reaper import Reaper
from megarl.procs import lifeline
plain = subprocess.Popen(["sleep", "300"], start_new_session=True)       # only the reaper can stop it
guarded = subprocess.Popen(lifeline.guarded(["sleep", "300"]), start_new_session=True)
reaper = Reaper.start(poll_s=0.01)  # returns once the reaper has seen both
print(plain.pid, guarded.pid, flush=True)
sys.stdin.readline()
if sys.argv[1] == "orderly":  # after many polls: a reaper that fails while watching is caught
    reaper.stop()
    print("stopped", reaper.process.returncode, flush=True)
sys.stdin.readline()
"""


def _parent(mode: str):
    import subprocess
    import sys

    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    plain, guarded = (psutil.Process(int(pid)) for pid in parent.stdout.readline().split())
    return parent, plain, guarded


def _dead(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def test_parent_sigkill_kills_a_guarded_child_and_the_reaper_kills_the_rest():
    parent, plain, guarded = _parent("crash")
    deadline = time.monotonic() + 10
    while guarded.cmdline() != ["sleep", "300"] and time.monotonic() < deadline:
        time.sleep(0.02)  # the guard is still setting itself up
    assert guarded.cmdline() == ["sleep", "300"]  # the guard exec'd: the pid is the command's
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    _wait_until_none_left(uuid.uuid4().hex, within_s=10, also=[plain, guarded])


def test_orderly_reaper_stop_kills_nothing():
    parent, plain, guarded = _parent("orderly")
    try:
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline().split() == ["stopped", "0"]  # the reaper exited cleanly
        parent.stdin.close()  # the parent exits normally
        parent.wait(timeout=10)
        _wait_until_none_left(uuid.uuid4().hex, within_s=10, also=[guarded])  # parent death: guarded goes
        assert not _dead(plain)  # the reaper was told the shutdown was orderly: it killed nothing
    finally:
        for process in (plain, guarded):
            if not _dead(process):
                process.kill()


def test_a_child_whose_parent_died_before_the_guard_was_set_dies_at_once():
    import subprocess
    import sys

    from megarl.procs import lifeline

    cmd = lifeline.guarded(["sleep", "300"])
    cmd[cmd.index("--") - 1] = "1"  # as if its parent had already died (the orphan's parent is init)
    child = subprocess.Popen(cmd)
    assert child.wait(timeout=10) == -signal.SIGKILL
    assert sys.platform.startswith("linux")
