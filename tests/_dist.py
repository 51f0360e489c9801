"""Run a function on N gloo ranks in fresh processes and collect what each returns."""

from __future__ import annotations

import io
import os
import queue as queue_module
import shutil
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


def _entry(rank, world_size, store_path, fn, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # a FileStore, not a TCP port: a free port picked by the parent can be taken by another
        # process before rank 0 listens on it (EADDRINUSE seen with tests running side by side)
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        # torch.save to bytes: tensors put on a Queue are shared by fd and die with this process.
        buf = io.BytesIO()
        torch.save(fn(rank, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # reported to the parent, which fails the test with it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 600, may_die: tuple[int, ...] = ()):
    """fn(rank, *args) on `world_size` gloo ranks; returns the results ordered by rank.

    Ranks in `may_die` may exit without a result (a test that kills them): theirs is None.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="megarl_ranks_")
    store_path = os.path.join(store_dir, "store")
    procs = [ctx.Process(target=_entry, args=(r, world_size, store_path, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, status, value = queue.get(timeout=0.2)
            except queue_module.Empty:
                gone = [r for r, p in enumerate(procs) if r not in results and not p.is_alive() and queue.empty()]
                for r in gone:
                    if r in may_die:
                        results[r] = None
                    else:
                        errors.append(f"rank {r}: exited with code {procs[r].exitcode} before reporting")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout} s") from None
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(store_dir, ignore_errors=True)
    if errors:
        raise RuntimeError("distributed test failed on " + "\n".join(errors))
    return [results[r] for r in range(world_size)]
