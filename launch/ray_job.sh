#!/usr/bin/env bash
# Submit `megarl train CONFIG [overrides]` to a running Ray cluster with `ray job submit`, stream
# its logs, and exit with the job's status (0 succeeded, 1 failed or stopped).
#
#   RAY_ADDRESS=http://HEAD:8265 launch/ray_job.sh configs/quickstart.yaml trainer.total_steps=50
#
# The run joins that cluster (cluster.address=auto: the job's driver finds the cluster it runs
# in) instead of starting its own. The repo is uploaded as the job's working dir, so every node
# imports the same megarl; each node needs the Python environment of .venv (same paths or an
# equivalent install), and a CPU cluster must declare the device resource on every node:
#   ray start --head --resources '{"megarl_device": 2}' ...
#
# Environment:
#   RAY_ADDRESS          required: the head's job-server (dashboard) address, http://HOST:8265
#   MEGARL_OUTPUT_DIR    trainer.output_dir for the run (default: ./outputs made absolute; use a
#                        path the head node can write, e.g. on a shared file system)
#   MEGARL_PYTHON        the Python the entrypoint runs on the head node (default: `python`;
#                        start `ray start` from an activated .venv, or set this to its python)
#   MEGARL_RAY           the `ray` command used to submit (default: .venv/bin/ray, else `ray`)
#   MEGARL_JOB_ENV       names of environment variables to pass on to the job, e.g. "HF_HOME"
#   MEGARL_SUBMISSION_ID the job's id (default: megarl-<time>-<pid>)
# Interrupting this script (Ctrl-C, SIGTERM) stops the job, not only the log stream.
set -euo pipefail

usage() { echo "usage: RAY_ADDRESS=http://HEAD:8265 $0 CONFIG.yaml [section.key=value ...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
case "$1" in -h|--help) usage ;; esac
if [ -z "${RAY_ADDRESS:-}" ]; then
  echo "ray_job.sh: RAY_ADDRESS is not set: export RAY_ADDRESS=http://HEAD:8265 (the Ray head's job server)" >&2
  exit 2
fi
config=$1; shift
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ ! -f "$repo/$config" ] && [ ! -f "$config" ]; then
  echo "ray_job.sh: config $config not found (give a path relative to the repo, e.g. configs/quickstart.yaml)" >&2
  exit 2
fi
# Inside the job the working dir is a copy of the repo, so the config is named relative to it.
if [ -f "$config" ] && [ ! -f "$repo/$config" ]; then
  echo "ray_job.sh: config $config is outside the repo; only the repo is uploaded, so copy it under configs/" >&2
  exit 2
fi

ray_cmd=${MEGARL_RAY:-}
if [ -z "$ray_cmd" ]; then
  if [ -x "$repo/.venv/bin/ray" ]; then ray_cmd=$repo/.venv/bin/ray; else ray_cmd=ray; fi
fi
python_cmd=${MEGARL_PYTHON:-python}
output_dir=${MEGARL_OUTPUT_DIR:-$PWD/outputs}
case "$output_dir" in /*) ;; *) output_dir=$PWD/$output_dir ;; esac
submission_id=${MEGARL_SUBMISSION_ID:-megarl-$(date +%Y%m%d-%H%M%S)-$$}

# runtime_env: the repo (minus what is not code) as the working dir; env vars for every process
# of the job. PYTHONPATH stays out of it: the driver sets that one itself (megarl/controller).
json_python=$repo/.venv/bin/python; [ -x "$json_python" ] || json_python=python3
env_args=()
for name in ${MEGARL_JOB_ENV:-}; do
  if [ -n "${!name+x}" ]; then env_args+=("$name=${!name}"); fi
done
runtime_env=$("$json_python" - "$repo" "${env_args[@]}" <<'PY'
import json, sys
env = {"TOKENIZERS_PARALLELISM": "false", **dict(a.split("=", 1) for a in sys.argv[2:])}
print(json.dumps({"working_dir": sys.argv[1], "env_vars": env,
                  "excludes": [".git", ".venv", "outputs", "runs", "__pycache__", "*.pyc"]}))
PY
)

# Overrides after ours win (later dotted overrides replace earlier ones), so a user's
# trainer.output_dir=... or cluster.address=... on the command line takes precedence.
entrypoint=("$python_cmd" -m megarl.cli train "$config" "cluster.address=auto" "trainer.output_dir=$output_dir" "$@")
printf -v entrypoint_str '%q ' "${entrypoint[@]}"

stop_job() {
  trap - INT TERM
  echo "ray_job.sh: interrupted; stopping job $submission_id" >&2
  "$ray_cmd" job stop --address "$RAY_ADDRESS" "$submission_id" >&2 || true
  exit 130
}
trap stop_job INT TERM

echo "ray_job.sh: submitting $submission_id to $RAY_ADDRESS: $entrypoint_str" >&2
# Submitted through the SDK with the entrypoint as one shell string: `ray job submit -- ARGS`
# re-joins its arguments with subprocess.list2cmdline (Windows quoting), which wraps any argument
# holding a space in double quotes, so neither one %q-quoted string nor the raw words survive
# /bin/sh intact. The SDK uploads the working dir and reads Ray's auth token as the CLI does.
if ! "$json_python" - "$RAY_ADDRESS" "$submission_id" "$runtime_env" "$entrypoint_str" <<'PY'
import json, sys
try:
    from ray.job_submission import JobSubmissionClient
except ImportError:
    sys.exit(f"ray_job.sh: {sys.executable} cannot import ray; run bash scripts/setup_env.sh")
address, submission_id, runtime_env, entrypoint = sys.argv[1:]
JobSubmissionClient(address).submit_job(entrypoint=entrypoint, submission_id=submission_id,
                                        runtime_env=json.loads(runtime_env))
PY
then
  echo "ray_job.sh: submitting $submission_id to $RAY_ADDRESS failed (above)" >&2
  exit 1
fi
# Follow the logs in the background + wait, so a signal reaches the trap while they stream.
"$ray_cmd" job logs --address "$RAY_ADDRESS" --follow "$submission_id" &
submit_pid=$!
set +e
wait "$submit_pid"
rc=$?
set -e
trap - INT TERM
# The log stream ends when the job does, whatever its end; ask for the status.
status=$("$ray_cmd" job status --address "$RAY_ADDRESS" "$submission_id" 2>&1 || true)
if grep -q "Job '$submission_id' succeeded" <<<"$status"; then
  exit 0
fi
echo "ray_job.sh: job $submission_id did not succeed (log stream exited $rc): $(grep -iE 'stopped|failed|status' <<<"$status" | head -n 3)" >&2
exit 1
