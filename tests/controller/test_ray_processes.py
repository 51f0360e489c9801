"""Which processes RayCluster counts as Ray's own (and so stops at exit): Ray's daemons and
workers, not a process that merely carries ray in an argument."""

from __future__ import annotations

import subprocess
import sys

import psutil

from megarl.controller.cluster import _is_ray_process


def test_a_ray_script_is_ray_and_a_forkserver_carrying_ray_on_its_sys_path_is_not(tmp_path):
    script = tmp_path / "site-packages" / "ray" / "dashboard" / "agent.py"
    script.parent.mkdir(parents=True)
    script.write_text("import time\ntime.sleep(60)\n")
    sleep = "import time; time.sleep(60)"
    # how multiprocessing starts its forkserver: the parent's sys.path (ray's entries too) in -c
    forkserver = f"{sleep}; main_kw = {{'sys_path': ['{tmp_path}/site-packages/ray/thirdparty_files']}}"
    procs = [
        subprocess.Popen([sys.executable, "-u", str(script), "--node-ip-address=127.0.0.1"]),
        subprocess.Popen([sys.executable, "-B", "-c", forkserver]),
    ]
    try:
        daemon, other = (psutil.Process(p.pid) for p in procs)
        assert _is_ray_process(daemon)
        assert not _is_ray_process(other)
    finally:
        for p in procs:
            p.kill()
            p.wait()
