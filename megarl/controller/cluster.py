"""RayCluster: own the Ray connection of the controller for the length of a `with` block.

    with RayCluster(num_cpus=2) as cluster:       # address None: a fresh local cluster
        group = RayWorkerGroup(...)
        ...
    # every Ray process this block started is gone, also after an exception, Ctrl-C or SIGTERM

With an address the block joins an existing cluster and only disconnects on exit; Ray then reclaims
the job's actors and placement groups.

A SIGKILL of this process runs no cleanup at all. A local cluster's gcs_server and raylet die with
it (Ray's parent-death signal), its workers within seconds; Ray's dashboard and runtime-env agents
would linger for a minute, so a local cluster also starts a Reaper (megarl/procs/reaper.py) that kills what
this process had started once it dies. Subprocesses of actors (rollout servers, the router) die
with their actor (megarl/procs/lifeline.py), on a local or an external cluster alike.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import psutil
import ray

from megarl.controller.worker_group import pythonpath_with_repo
from megarl.procs.reaper import Reaper

logger = logging.getLogger(__name__)

_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RayCluster:
    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        object_store_memory: int | None = None,
        resources: dict[str, float] | None = None,
        log_to_driver: bool = True,
        runtime_env: dict[str, Any] | None = None,
        namespace: str | None = None,
        handle_signals: bool = True,
        shutdown_grace_s: float = 10.0,
    ) -> None:
        if address is not None and (
            num_cpus is not None or num_gpus is not None or object_store_memory is not None or resources
        ):
            raise ValueError(
                f"RayCluster(address={address!r}) joins an existing cluster whose resources are fixed; "
                "num_cpus/num_gpus/object_store_memory/resources only apply when starting a local cluster (address=None)"
            )
        self.address = address
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.object_store_memory = object_store_memory
        self.resources = dict(resources or {})
        self.log_to_driver = log_to_driver
        self.runtime_env = _with_repo_on_pythonpath(runtime_env)
        self.namespace = namespace
        self.handle_signals = handle_signals
        self.shutdown_grace_s = shutdown_grace_s
        self._started = False
        self._preexisting_children: set[int] = set()
        self._previous_handlers: dict[int, Any] = {}
        self._terminated_by: int | None = None
        self._reaper: Reaper | None = None
        self._starting: _Starting | None = None  # a background start not waited for yet
        self._ray_thread: _Starting | None = None  # the thread that started Ray, kept alive

    def __enter__(self) -> RayCluster:
        if self._starting is not None:  # start(background=True) ran: wait for it
            self.wait_started()
        else:
            self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
        signum, self._terminated_by = self._terminated_by, None
        if signum is not None:
            # Ray turns a SystemExit raised inside ray.get into SystemExit(1); restore the
            # conventional 128 + signal code so supervisors see a clean, signalled exit.
            raise SystemExit(128 + signum) from None

    def start(self, background: bool = False) -> None:
        """Start (or join) the cluster. background=True returns at once with ray.init running on a
        thread: a local Ray takes ~6 s to come up on 2 cores, mostly waiting for its daemons,
        which the driver spends importing torch and transformers and building the model and data
        instead (`megarl train` does). What needs the main thread (signal handlers, the reaper)
        is done here, before returning; `with cluster:` or wait_started() joins the thread."""
        if ray.is_initialized() or self._starting is not None:
            raise RuntimeError(
                "Ray is already initialized in this process; RayCluster must own the connection so it can "
                "clean up. Call ray.shutdown() first, or use the existing connection without RayCluster."
            )
        self._preexisting_children = {p.pid for p in psutil.Process().children(recursive=True)}
        # Remember the handlers from before ray.init (which installs a SIGTERM handler of its own)
        # so close() leaves the process as it found it.
        self._remember_signal_handlers()
        try:
            if self.address is None:  # before ray.init, so a kill during start-up is covered too
                self._reaper = Reaper.start(exclude=self._preexisting_children)
            if background:
                self._starting = _Starting(self._connect)
                return
            self._connect()
        except BaseException:
            self._stop_reaper()
            self._restore_signal_handlers()
            raise
        self._started = True
        self._install_signal_handlers()

    def wait_started(self) -> None:
        """Wait for a background start; raises what ray.init raised. A no-op without one."""
        if self._starting is None:
            return
        self._starting.connected.wait()  # a Ctrl-C here leaves _starting set: close() waits again
        starting, self._starting = self._starting, None
        if starting.error is not None:
            starting.join()
            self._stop_reaper()
            self._restore_signal_handlers()
            raise starting.error
        self._ray_thread = starting
        self._started = True
        self._install_signal_handlers()

    def _connect(self) -> None:
        common = dict(log_to_driver=self.log_to_driver, runtime_env=self.runtime_env, namespace=self.namespace)
        if self.address is None:
            # "local" always starts a new cluster; None would silently join one left by `ray start`.
            ray.init(
                address="local",
                num_cpus=self.num_cpus,
                num_gpus=self.num_gpus,
                object_store_memory=self.object_store_memory,
                resources=self.resources or None,
                include_dashboard=False,
                # Ray forks idle workers for the first driver before it knows the job's runtime_env;
                # every worker here runs under that env (PYTHONPATH) or an actor's own, so none was
                # ever used: 2 processes importing Ray (~1.4 s of CPU) while the run starts.
                _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False},
                **common,
            )
        else:
            ray.init(address=self.address, **common)

    def close(self) -> None:
        """Shut Ray down and make sure no Ray process started by this cluster outlives it."""
        if self._starting is not None:  # started in the background and never waited for
            try:
                self.wait_started()
            except Exception as err:  # noqa: BLE001  (the run failed before it needed Ray)
                logger.warning("RayCluster: the background start failed too: %s", err)
                return
        if not self._started:
            return
        self._started = False
        self._ignore_signals_during_shutdown()
        try:
            started_here = self._ray_processes_started_here()
            ray.shutdown()
            _reap(started_here, self.shutdown_grace_s)
        finally:
            if self._ray_thread is not None:
                self._ray_thread.finish()
                self._ray_thread = None
            self._stop_reaper()
            self._restore_signal_handlers()

    def _stop_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.stop()
            self._reaper = None

    def _ray_processes_started_here(self) -> list[psutil.Process]:
        """Ray processes below this one (raylet workers are re-parented when the raylet exits, so
        they are recorded now, before shutdown)."""
        processes = []
        for process in psutil.Process().children(recursive=True):
            if process.pid not in self._preexisting_children and _is_ray_process(process):
                processes.append(process)
        return processes

    # ---- signals --------------------------------------------------------------------------------

    def _remember_signal_handlers(self) -> None:
        if not self.handle_signals:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning("RayCluster: not in the main thread, so SIGINT/SIGTERM cleanup handlers are not installed")
            return
        self._previous_handlers = {signum: signal.getsignal(signum) for signum in _HANDLED_SIGNALS}

    def _install_signal_handlers(self) -> None:
        for signum in self._previous_handlers:
            signal.signal(signum, self._raise_to_unwind)

    def _raise_to_unwind(self, signum: int, frame: FrameType | None) -> None:
        """Turn the signal into an exception so every `with` block (worker groups, the cluster) exits."""
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        self._terminated_by = signum
        raise SystemExit(128 + signum)

    def _ignore_signals_during_shutdown(self) -> None:
        # A second Ctrl-C must not interrupt ray.shutdown halfway and leave processes behind.
        for signum in self._previous_handlers:
            signal.signal(signum, _log_ignored_signal)

    def _restore_signal_handlers(self) -> None:
        # getsignal returns None for a handler not installed from Python; SIG_DFL is the closest.
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers = {}


class _Starting(threading.Thread):
    """ray.init on a thread of its own (RayCluster.start(background=True)), which then stays alive
    until the cluster is closed: Ray starts gcs_server and the raylet under a parent-death signal
    (PR_SET_PDEATHSIG), and Linux sends it when the *thread* that forked them exits (seen: the
    GCS gone and the driver dead 60 s later when this thread returned after ray.init)."""

    def __init__(self, connect) -> None:
        super().__init__(name="megarl-ray-start", daemon=True)
        self._connect, self.error = connect, None
        self.connected, self._release = threading.Event(), threading.Event()
        self.start()

    def run(self) -> None:
        # ray.init says it did not set a SIGTERM handler off the main thread: RayCluster installs
        # its own in the main thread once connected (wait_started), as a foreground start does.
        quiet = _DropMessage("SIGTERM handler is not set")
        ray_logger = logging.getLogger("ray._private.worker")
        ray_logger.addFilter(quiet)
        try:
            self._connect()
        except BaseException as err:  # noqa: BLE001  (raised in the caller's thread by wait_started)
            self.error = err
        finally:
            ray_logger.removeFilter(quiet)
            self.connected.set()
        if self.error is None:
            self._release.wait()  # until close(): Ray's processes were forked by this thread

    def finish(self) -> None:
        self._release.set()
        self.join()


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def _log_ignored_signal(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    logger.warning("RayCluster: %s received while shutting down Ray; finishing the shutdown first", name)


def _is_ray_process(process: psutil.Process) -> bool:
    try:
        name = process.name()
        cmdline = process.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return False
    if name in ("raylet", "gcs_server") or name.startswith("ray::"):
        return True
    # Ray's python daemons and workers run a script of the ray package (dashboard, agents, log
    # monitor, setup worker); a process that only mentions ray in an argument is not one (a
    # multiprocessing forkserver started here carries sys.path, ray's own entries included, in its -c)
    script = next((arg for arg in cmdline[1:] if arg.endswith(".py")), "")
    return "/ray/" in script


def _reap(processes: list[psutil.Process], grace_s: float) -> None:
    """Wait for `processes` to exit after ray.shutdown; terminate, then kill, any that linger."""
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    if not alive:
        return
    pids = [p.pid for p in alive]
    logger.warning("RayCluster: %d Ray processes outlived ray.shutdown(); terminating %s", len(alive), pids)
    for process in alive:
        _signal_quietly(process, kill=False)
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for process in alive:
        _signal_quietly(process, kill=True)
    psutil.wait_procs(alive, timeout=grace_s)


def _signal_quietly(process: psutil.Process, *, kill: bool) -> None:
    try:
        process.kill() if kill else process.terminate()
    except psutil.NoSuchProcess:
        pass  # exited between the check and the signal: that is what we wanted


def _with_repo_on_pythonpath(runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    """Workers must import megarl even where it is not pip-installed: put the repo on PYTHONPATH."""
    runtime_env = dict(runtime_env or {})
    env_vars = dict(runtime_env.get("env_vars", {}))
    env_vars["PYTHONPATH"] = pythonpath_with_repo(env_vars.get("PYTHONPATH"))
    runtime_env["env_vars"] = env_vars
    return runtime_env
