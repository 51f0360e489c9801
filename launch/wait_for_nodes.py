"""Wait until a Ray cluster has N alive nodes (used by launch/slurm.sbatch).

    python launch/wait_for_nodes.py HEAD_IP:PORT N --timeout 300 --watch PID [PID ...]

Exits 0 once N nodes are alive; 1 when the deadline passes or a watched process (the `srun` that
runs `ray start` on a node) exits first, since then that node will never join. Polls the GCS
through a driver connection; a driver that connects before the head is up just retries.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A child that exited but was not yet reaped by its parent (the batch shell) is a zombie.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("address")
    parser.add_argument("nodes", type=int)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--watch", type=int, nargs="*", default=[])
    args = parser.parse_args(argv)

    import ray

    deadline = time.monotonic() + args.timeout
    alive, error = 0, "no connection yet"
    while time.monotonic() < deadline:
        dead = [pid for pid in args.watch if not _alive(pid)]
        if dead:
            print(
                f"wait_for_nodes: the node launcher(s) {dead} exited before their node joined; "
                "see the job's output above",
                file=sys.stderr,
            )
            return 1
        try:
            if not ray.is_initialized():
                ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
            alive = sum(1 for n in ray.nodes() if n["Alive"])
            if alive >= args.nodes:
                print(f"wait_for_nodes: {alive} Ray nodes alive at {args.address}", flush=True)
                ray.shutdown()
                return 0
        except (ConnectionError, RuntimeError, ValueError) as err:  # head not up yet
            error = str(err).splitlines()[0] if str(err) else type(err).__name__
        time.sleep(1.0)
    print(
        f"wait_for_nodes: {alive} of {args.nodes} Ray nodes alive at {args.address} after "
        f"{args.timeout:.0f}s ({error}); raise MEGARL_NODE_TIMEOUT or check the nodes' ray logs",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
