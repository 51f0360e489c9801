"""The trackers of trainer.loggers beyond the console and metrics.jsonl: tensorboard, Weights &
Biases, MLflow. Each writer takes a step's metrics under the names metrics.jsonl uses (MLflow:
the characters it refuses replaced, mlflow_name), at the trainer step, and imports its library only when the run lists it (validation has checked that it
is installed: megarl/config/validate_trackers.py).

A resumed run continues the same tracker run: the ids are kept in RUN_DIR/trackers.json. What a
killed run logged after its last checkpoint: tensorboard hides it (purge_step); wandb and MLflow
cannot delete logged points, so those steps keep the killed run's values (online wandb refuses a step
below one it has seen) or hold both runs' values (MLflow); metrics.jsonl holds only the resumed run's.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

from megarl.config.loader import dump, to_dict
from megarl.config.schema import RunConfig

STATE_FILE = "trackers.json"


class TensorboardWriter:
    def __init__(self, log_dir: Path, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: tensorboard hides the events of steps >= it written by the killed run
        self.writer = SummaryWriter(str(log_dir), purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self, failed: bool = False) -> None:
        self.writer.flush()
        self.writer.close()


class WandbWriter:
    def __init__(self, cfg: RunConfig, run_dir: Path, run_id: str):
        import wandb

        w = cfg.trainer.wandb
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            mode=w.mode,
            group=w.group,
            tags=w.tags or None,
            name=cfg.trainer.experiment_name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=to_dict(cfg),
            allow_val_change=True,  # a resumed run may change keys (e.g. trainer.total_steps)
            # the step lines and Ray's output stay on the terminal as they are; wandb gets metrics
            settings=wandb.Settings(console="off"),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, failed: bool = False) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # finish() can return before wandb's service has written the run's last records
        # (RUN_DIR/wandb/*/run-<id>.wandb, what `wandb sync` uploads); teardown waits for it
        wandb.teardown()


def mlflow_name(key: str) -> str:
    """`key` as an MLflow metric name: MLflow allows letters, digits, _ - . / : and space, so the
    other characters (the @ of val/<source>/pass@k) become _."""
    return re.sub(r"[^/\w.\- :]", "_", key)


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """The nested config as dotted keys, each value as text within MLflow's param-length limit."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:MAX_PARAM_VAL_LENGTH]
    return out


class MlflowWriter:
    def __init__(self, cfg: RunConfig, tracking_uri: str, run_id: str | None, resume_step: int):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if tracking_uri.startswith("file:"):
            # MLflow refuses its file store unless told it was chosen on purpose; a file: URI is that choice
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=tracking_uri)
        m = cfg.trainer.mlflow
        logged = {}
        if run_id is None:
            experiment = self.client.get_experiment_by_name(m.experiment_name)
            eid = experiment.experiment_id if experiment else self.client.create_experiment(m.experiment_name)
            run_id = self.client.create_run(eid, run_name=cfg.trainer.experiment_name).info.run_id
        else:
            logged = self.client.get_run(run_id).data.params
            self.client.update_run(run_id, status="RUNNING")
            self.client.set_tag(run_id, "megarl.resumed_after_step", str(resume_step))
        self.run_id = run_id
        # MLflow refuses to change a logged param: a resumed run adds only keys the run lacks
        params = [Param(k, v) for k, v in flat_params(to_dict(cfg)).items() if k not in logged]
        for i in range(0, len(params), 100):  # MLflow's limit of params per batch
            self.client.log_batch(run_id, params=params[i : i + 100])
        self.client.log_text(run_id, dump(cfg), "config.yaml")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_name(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow's limit of metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def make_trackers(cfg: RunConfig, run_dir: Path, resume_step: int) -> list:
    """The writers of cfg.trainer.loggers other than console and jsonl (MetricsLogger's own); a
    run continuing after `resume_step` > 0 reopens the tracker runs RUN_DIR/trackers.json names."""
    state_path = run_dir / STATE_FILE
    old = json.loads(state_path.read_text()) if resume_step and state_path.is_file() else {}
    state, writers = {}, []
    try:
        for name in cfg.trainer.loggers:
            if name == "tensorboard":
                writers.append(TensorboardWriter(run_dir / "tensorboard", resume_step))
            elif name == "wandb":
                state["wandb"] = {"id": old.get("wandb", {}).get("id") or uuid.uuid4().hex[:12]}
                writers.append(WandbWriter(cfg, run_dir, state["wandb"]["id"]))
            elif name == "mlflow":
                uri = cfg.trainer.mlflow.tracking_uri or (run_dir / "mlruns").resolve().as_uri()
                before = old.get("mlflow", {})  # its run id means nothing in another store
                run_id = before.get("run_id") if before.get("tracking_uri") == uri else None
                writers.append(MlflowWriter(cfg, uri, run_id, resume_step))
                state["mlflow"] = {"run_id": writers[-1].run_id, "tracking_uri": uri}
    except BaseException:
        for writer in writers:  # the run does not start: those already open end as failed
            writer.close(failed=True)
        raise
    if state:
        state_path.write_text(json.dumps(state, indent=2) + "\n")
    return writers
