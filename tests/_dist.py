"""Run a function on N gloo ranks in fresh processes and collect what each returns.

The ranks fork from one forkserver per test session that imported the heavy third-party modules
once (torch, megatron-core, mbridge, transformers): a spawned rank imports them again, ~3.5 s of
CPU each, which was most of a two-rank test's time on 2 cores. Each rank is still a new process,
with nothing of the project imported and no state of an earlier test: the forkserver only imports
(third-party modules, no project code, no torch op), and the rank takes the caller's environment
of the moment, not the forkserver's, so a test's `monkeypatch.setenv` reaches its ranks as before.
"""

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

# imported once by the forkserver; a module that is not installed is skipped by multiprocessing
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
    "mbridge",
]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank, world_size, store_path, fn, args, queue, environ):
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(environ)
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
    ctx = _context()
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="megarl_ranks_")
    store_path = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, store_path, fn, args, queue, dict(os.environ)))
        for r in range(world_size)
    ]
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
