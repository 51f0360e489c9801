"""torch's file_system shared memory that a killed worker leaves in /dev/shm.

torch names each such file /dev/shm/torch_<creator pid>_<random>_<n> (the bridge's tensor
transport shares its bucket buffers this way: megarl/wire/weights_codec.py) and relies on the creator's
`torch_shm_manager` daemon to unlink it once every process attached to it is gone. A worker
killed with its children (Ray's actor kill and cluster shutdown) takes the manager with it, and
the files stay until reboot: measured on the CPU machine, 88 files of 16 MiB (1.4 GiB of RAM)
after one session of quickstart runs. Once the creating process has exited, its files can belong
to nobody else, so the worker group removes them (megarl/controller/worker_group.py).

A driver killed outright (SIGKILL, the OOM killer) never reaches that shutdown: Ray then ends its
ranks and their files stay, 16 MiB a rank for every kill of a crash-and-resume loop. So a run
records its local ranks' pids in its run directory (`record_ranks`), and a run started in the
same directory (trainer.resume) removes the files of recorded ranks that no longer exist
(`remove_recorded_leftovers`); recorded ranks still running then (Ray ends a dead driver's
workers a few seconds later) are recorded again and swept when that run ends. Only recorded pids
are touched, and only when no process with that pid runs here: /dev/shm may be shared with other
pid namespaces (containers run with --ipc=host), whose live files a sweep of every dead-looking
pid would delete.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


def remove_torch_shm_files(pids: list[int], timeout_s: float = 2.0, shm_dir: str = SHM_DIR) -> int:
    """Wait up to timeout_s for these (local, just killed) processes to exit, then remove the
    torch shared-memory files each exited one created; returns how many were removed. A process
    still running keeps its files."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    running = {p.pid for p in alive if _runs(p.pid)}
    removed = 0
    for pid in pids:
        if pid in running:
            logger.debug("pid %d still runs: its torch shared-memory files stay", pid)
            continue
        removed += _remove_files_of(pid, shm_dir)
    return removed


def _remove_files_of(pid: int, shm_dir: str) -> int:
    removed = 0
    for path in glob.glob(os.path.join(shm_dir, f"torch_{pid}_*")):
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass  # removed meanwhile (its manager did it after all)
    return removed


def _runs(pid: int) -> bool:
    """Whether a process with this pid exists and is not a zombie. A killed rank whose parent (the
    raylet) died too stays a zombie until init reaps it; its mappings are gone already."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def record_ranks(path: Path, processes: list[dict], node: str, also: Iterable[int] = ()) -> None:
    """Write the pids of `processes` ({"pid", "node"} per rank) that run on `node`, and `also`, to
    `path` (atomically), for remove_recorded_leftovers at this run's end or in a later run."""
    pids = sorted({p["pid"] for p in processes if p.get("node") == node and p.get("pid")} | set(also))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"node": node, "pids": pids}))
    os.replace(tmp, path)


def remove_recorded_leftovers(path: Path, node: str, shm_dir: str = SHM_DIR) -> list[int]:
    """Remove the torch shared-memory files of the ranks `path` recorded on `node` whose process
    no longer exists (a killed earlier run in this run directory). Returns the recorded pids that
    still run: a killed driver's ranks may outlive it for a few seconds, until Ray ends them."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return []  # no earlier run here, or a record cut short: nothing known to remove
    if record.get("node") != node:
        return []  # recorded on another machine: its pids mean nothing here
    removed, running = 0, []
    for pid in record.get("pids", []):
        if not isinstance(pid, int):
            continue
        if _runs(pid):
            running.append(pid)  # a live process (perhaps another one with a reused pid) keeps its files
            continue
        removed += _remove_files_of(pid, shm_dir)
    if removed:
        logger.info(
            "removed %d torch shared-memory files in %s left by the killed ranks of an earlier run", removed, shm_dir
        )
    return running
