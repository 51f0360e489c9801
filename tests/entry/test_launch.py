"""launch/: `ray job submit` into a running Ray cluster, and a real two-node Slurm cluster.

1. A Ray head started here (its own temp dir and ports, `ray start --block`, stopped by pid)
   takes `launch/ray_job.sh configs/quickstart.yaml trainer.total_steps=5 ...`: the job
   succeeds, writes 5 metric rows, and its Megatron ranks ran as actors of that cluster (the
   run joined it instead of starting its own).
2. A local Slurm cluster (slurmctld + two slurmd "nodes" n1, n2 on 127.0.0.1, its own munged,
   everything under one temp dir, SLURM_CONF pointing there; docs/clusters.md) runs
   `sbatch --nodes=2 launch/slurm.sbatch` for a disaggregated quickstart stopped mid-run by the
   time-limit signal (SIGUSR1 to the batch script): the job saves a checkpoint and completes with
   exit 0, its metric rows are all there, the actor ranks ran on one node's Ray and the rollout
   engine on the other's, and no process the job started is left afterwards.
   Skipped, saying how to enable it, without slurmctld/slurmd/munged or without root.

Every process a job starts inherits the environment, so a marker variable finds leftovers.
Measured on the 2-core machine: about 40 s (Ray job) and 50 s (Slurm) while it was otherwise idle.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
MARKER = "MEGARL_TEST_LAUNCH_ID"
# 5 steps of the quickstart task, as small as validation allows: 4 prompts x 4 samples = 16 rows.
SMALL = [
    "trainer.total_steps=5",
    "data.train_batch_size=4",
    "data.num_train=32",
    "data.num_val=8",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=16",
    "actor.micro_batch_size=8",
    "trainer.val_every=0",
    "trainer.loggers=[console,jsonl]",
]


# ---- helpers ---------------------------------------------------------------------------------------


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _marked(run_id: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid != os.getpid() and proc.environ().get(MARKER) == run_id:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _wait_until_gone(run_id: str, within_s: float) -> list[str]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and _marked(run_id):
        time.sleep(0.2)
    left = []
    for proc in _marked(run_id):  # clean up before failing, so one failure does not poison others
        try:
            left.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return left


def _stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace_s)


def _poll(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode} first")
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")


def _metric_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


# ---- 1. ray job submit -----------------------------------------------------------------------------

# Ray >= 2.5x turns token authentication on for a new cluster once a token exists in ~/.ray (any
# earlier `ray.init()` on the machine writes one), and its job server then answers 401 to requests
# without the token. The test pins the mode and its own token, so it runs the same on a fresh
# machine and on one where Ray ran before, and it exercises the authenticated path users meet.
RAY_AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def _get(url: str, timeout: float):
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {RAY_AUTH['RAY_AUTH_TOKEN']}"})
    return urllib.request.urlopen(request, timeout=timeout)


@pytest.fixture(scope="module")  # torn down with this module: other modules count Ray processes
def ray_head():
    """A one-node Ray cluster as a user starts it, with the job server and 2 CPU devices."""
    tmp = Path(tempfile.mkdtemp(prefix="mrl-ray-"))  # short: Ray's unix sockets live below it
    gcs, dashboard, client, agent, agent_grpc, runtime_env, metrics = _free_ports(7)
    run_id = uuid.uuid4().hex
    log = open(tmp / "ray_start.log", "w")
    head = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            "--disable-usage-stats",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            f"--dashboard-port={dashboard}",
            "--dashboard-host=127.0.0.1",
            f"--ray-client-server-port={client}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={runtime_env}",
            f"--metrics-export-port={metrics}",
            "--include-dashboard=true",
            f"--temp-dir={tmp / 'r'}",
            "--num-cpus=2",
            '--resources={"megarl_device": 2}',
        ],
        cwd=tmp,
        env={**os.environ, **RAY_AUTH, MARKER: run_id, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    address = f"http://127.0.0.1:{dashboard}"

    def job_server_up() -> bool:
        try:
            with _get(f"{address}/api/version", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        _poll(job_server_up, 90, "Ray head's job server", head)
        yield address, run_id, tmp
    finally:
        _stop(head)
        log.close()
        left = _wait_until_gone(run_id, 30)
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"Ray processes left after stopping the head: {left}"


def test_ray_job_submit_runs_quickstart_on_the_cluster(ray_head):
    address, run_id, tmp = ray_head
    out_dir = tmp / "outputs"
    start = time.monotonic()
    result = subprocess.run(
        ["bash", "launch/ray_job.sh", "configs/quickstart.yaml", *SMALL],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        env={
            **os.environ,
            **RAY_AUTH,
            "RAY_ADDRESS": address,
            "MEGARL_OUTPUT_DIR": str(out_dir),
            "MEGARL_PYTHON": PYTHON,
            "MEGARL_SUBMISSION_ID": f"megarl-test-{run_id[:8]}",
        },
    )
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"ray_job.sh failed ({result.returncode}):\n{output[-4000:]}"
    assert "succeeded" in output, output[-2000:]
    assert _metric_steps(out_dir / "quickstart") == [1, 2, 3, 4, 5]
    # The Megatron ranks were actors of this cluster: the run joined it.
    query = "filter_keys=class_name&filter_predicates=%3D&filter_values=MegatronActor&detail=false"
    with _get(f"{address}/api/v0/actors?{query}", timeout=30) as r:
        actors = json.load(r)["data"]["result"]["result"]
    assert len(actors) == 2, actors
    print(f"ray_job.sh 5-step quickstart: {elapsed:.1f}s")


# ---- 2. Slurm ----------------------------------------------------------------------------------------

SLURM_TOOLS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "sinfo")
ENABLE = (
    "install Debian's slurm-wlm and munge (apt-get install slurm-wlm munge; .ci/run does this "
    "when it runs as root) and run the tests as root"
)


def _slurm_conf(tmp: Path, ctld_port: int, node_ports: list[int], munge_socket: Path) -> str:
    nodes = "\n".join(
        f"NodeName=n{i + 1} NodeAddr=127.0.0.1 Port={p} CPUs=2 RealMemory=4000 State=UNKNOWN"
        for i, p in enumerate(node_ports)
    )
    return f"""\
ClusterName=megarltest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={node_ports[0]}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MailProg=/bin/true
KillWait=10
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool/%n
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.%n.pid
SlurmctldLogFile={tmp}/log/slurmctld.log
SlurmdLogFile={tmp}/log/slurmd.%n.log
{nodes}
PartitionName=debug Nodes={",".join(f"n{i + 1}" for i in range(len(node_ports)))} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture(scope="module")  # torn down with this module: other modules count Ray processes
def slurm_cluster():
    """slurmctld + slurmd n1, n2 + munged, all foreground children of this process, all files
    under one temp dir; stopped by pid."""
    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no local Slurm ({', '.join(missing)} missing): {ENABLE}")
    if os.geteuid() != 0:
        pytest.skip(f"the local Slurm cluster needs root (slurmd starts job steps as their user): {ENABLE}")
    tmp = Path(tempfile.mkdtemp(prefix="mrl-slurm-"))
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; munged (user munge) must reach its dir below
        munge_dir = tmp / "munge"
        munge_dir.mkdir(mode=0o755)  # munged wants its socket dir reachable by all
        for sub in ("state", "spool/n1", "spool/n2", "log"):
            (tmp / sub).mkdir(parents=True)
        key, sock = munge_dir / "munge.key", munge_dir / "munge.socket"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        shutil.chown(munge_dir, "munge", "munge")
        shutil.chown(key, "munge", "munge")

        def spawn(argv: list[str], name: str) -> subprocess.Popen:
            log = open(tmp / "log" / f"{name}.out", "w")
            logs.append(log)
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
            procs.append(proc)
            return proc

        munged = spawn(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                "munged",
                "--foreground",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={munge_dir / 'munged.log'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
            "munged",
        )
        _poll(sock.exists, 20, "munged socket", munged)
        ctld_port, *node_ports = _free_ports(3)
        conf = tmp / "slurm.conf"
        conf.write_text(_slurm_conf(tmp, ctld_port, node_ports, sock))
        env = {**os.environ, "SLURM_CONF": str(conf)}
        os.environ["SLURM_CONF"] = str(conf)  # the daemons and every slurm command read it
        ctld = spawn(["slurmctld", "-D", "-i", "-f", str(conf)], "slurmctld")
        for node in ("n1", "n2"):
            spawn(["slurmd", "-D", "-N", node, "-f", str(conf)], f"slurmd-{node}")

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%T %D"], capture_output=True, text=True, env=env)
            return out.stdout.split() == ["idle", "2"]

        _poll(idle, 60, "two idle Slurm nodes", ctld)
        yield tmp, env
    finally:
        os.environ.pop("SLURM_CONF", None)
        for proc in reversed(procs):  # slurmds, slurmctld, then munged
            _stop(proc)
        for log in logs:
            log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _logs_naming(ray_tmp: Path, text: str) -> bool:
    """Whether a Ray worker log of this node's session names `text` (Ray writes the actor's
    class name into its worker's log: `:actor_name:MegatronActor`)."""
    for path in ray_tmp.glob("session_*/logs/worker-*"):
        try:
            if text in path.read_text(errors="replace"):
                return True
        except OSError:
            continue
    return False


def test_slurm_two_nodes_quickstart_stopped_by_its_time_limit_signal(slurm_cluster):
    """The job runs until Slurm's time-limit signal (SIGUSR1 to the batch script, what
    `#SBATCH --signal=B:USR1@300` sends; here by hand with scancel): the script passes it to the
    driver, which finishes its step, saves a checkpoint and exits 0, and so does the job."""
    tmp, env = slurm_cluster
    run_id = uuid.uuid4().hex
    out_dir = tmp / "outputs"
    job_out = tmp / "job.out"
    env = {
        **env,
        MARKER: run_id,
        "MEGARL_DEVICES_PER_NODE": "2",
        "MEGARL_PYTHON": PYTHON,
        "MEGARL_RAY_TMPDIR": str(tmp),
        "MEGARL_STOP_GRACE": "15",
    }
    start = time.monotonic()
    sbatch = subprocess.Popen(
        [
            "sbatch",
            "--wait",
            "--parsable",
            "--nodes=2",
            f"--output={job_out}",
            "launch/slurm.sbatch",
            "configs/quickstart.yaml",
            *SMALL,
            "trainer.total_steps=1000",  # stopped by the signal, long before
            f"trainer.output_dir={out_dir}",
            # actor ranks on one node (2 devices), the engine on the other (1 device of its own pool)
            "cluster.placement=disaggregated",
            "bridge.transport=reshard",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    job_id = sbatch.stdout.readline().strip().split(";")[0]  # --parsable prints it at submission
    _poll(lambda: job_out.exists() and "step 3/1000" in job_out.read_text(), 400, "step 3 of the job", sbatch)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, env=env, timeout=30)
    _, err = sbatch.communicate(timeout=300)
    elapsed = time.monotonic() - start
    output = job_out.read_text() if job_out.exists() else "(no job output)"
    assert sbatch.returncode == 0, f"sbatch --wait: {sbatch.returncode} {err}\n{output[-5000:]}"
    assert "2 Ray nodes alive" in output, output[-3000:]
    assert "received USR1; megarl train saves a checkpoint" in output, output[-3000:]
    assert "megarl train exited with 0" in output, output[-3000:]
    steps = _metric_steps(out_dir / "quickstart")
    n = steps[-1]
    assert steps == list(range(1, n + 1)) and n >= 3, steps
    assert f"megarl: stopped by SIGUSR1 after step {n}/1000; checkpoint " in output, output[-3000:]
    assert (out_dir / "quickstart" / "checkpoints" / f"step_{n:06d}" / "trainer_state.json").exists()
    # Each Slurm node ran its own Ray node (temp dir per node index); the actor ranks ran on one,
    # the rollout engine's launcher on the other.
    ray_dirs = [tmp / f"megarl-ray-{job_id}-{i}" for i in range(2)]
    actor_on = [_logs_naming(d, "MegatronActor") for d in ray_dirs]
    engine_on = [_logs_naming(d, "EngineLauncher") for d in ray_dirs]
    assert sorted([actor_on.index(True), engine_on.index(True)]) == [0, 1], (actor_on, engine_on)
    assert actor_on.count(True) == 1 and engine_on.count(True) == 1, (actor_on, engine_on)
    left = _wait_until_gone(run_id, 20)
    assert not left, f"processes of the job left running: {left}"
    print(f"slurm.sbatch 2-node quickstart stopped by SIGUSR1 after step {n}: {elapsed:.1f}s")
