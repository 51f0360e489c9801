"""torch's file_system shared memory that a killed worker leaves in /dev/shm.

torch names each such file /dev/shm/torch_<creator pid>_<random>_<n> (the bridge's tensor
transport shares its bucket buffers this way: weights_codec.py) and relies on the creator's
`torch_shm_manager` daemon to unlink it once every process attached to it is gone. A worker
killed with its children (Ray's actor kill and cluster shutdown) takes the manager with it, and
the files stay until reboot: measured on the CPU machine, 88 files of 16 MiB (1.4 GiB of RAM)
after one session of quickstart runs. Once the creating process has exited, its files can belong
to nobody else, so the worker group removes them (megarl/controller/worker_group.py).
"""

from __future__ import annotations

import glob
import logging
import os

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
    running = {p.pid for p in alive}
    removed = 0
    for pid in pids:
        if pid in running:
            logger.debug("pid %d still runs: its torch shared-memory files stay", pid)
            continue
        for path in glob.glob(os.path.join(shm_dir, f"torch_{pid}_*")):
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass  # removed meanwhile (its manager did it after all)
    return removed
