"""trainer.loggers: wandb (offline) and MLflow (a local file store) through the real MetricsLogger
hold exactly what metrics.jsonl holds, at the same steps, with the run's config attached; a resumed
run continues the same tracker runs; a tracker that is not installed, a list without jsonl and the
old trainer.tensorboard key are refused before anything starts."""

from __future__ import annotations

import glob
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest
import yaml

from megarl.config.loader import ConfigError, dump, load_config, to_dict
from megarl.trainer.metrics import MetricsLogger
from megarl.trainer.trackers import flat_params, make_trackers, mlflow_name
from tests.trainer import _wandb_log

ROOT = Path(__file__).resolve().parents[2]
# a metric name MLflow refuses as it is (@), one with a data source's own /, plain ones
STEPS = {
    1: {"reward/mean": 0.125, "actor/kl": 0.001, "val/openai/gsm8k/pass@4": 0.25},
    2: {"reward/mean": 0.25, "actor/kl": 0.002},
    3: {"reward/mean": 0.5, "actor/kl": 0.004, "val/openai/gsm8k/pass@4": 0.5},
}


def _cfg(tmp_path: Path, loggers: str, *more: str):
    return load_config(
        ROOT / "configs/quickstart.yaml",
        [f"trainer.loggers={loggers}", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=track", *more],
    )


def _log(cfg, run_dir: Path, steps: dict, resume_step: int = 0, failed: bool = False) -> None:
    """The run's way: run.run_logger's trackers, through the real MetricsLogger."""
    run_dir.mkdir(parents=True, exist_ok=True)
    logger = MetricsLogger(
        make_trackers(cfg, run_dir, resume_step),
        max(steps),
        stream=io.StringIO(),
        jsonl_path=run_dir / "metrics.jsonl",
        resume_step=resume_step,
    )
    for step, metrics in steps.items():
        logger.log(step, metrics)
    logger.close(failed=failed)


def _jsonl_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    series = {}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        for key, value in record.items():
            if key != "step":
                series.setdefault(key, []).append((record["step"], value))
    return series


def _mlflow_series(run_dir: Path, keys) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    out = {}
    for key in keys:
        history = sorted(client.get_metric_history(state["run_id"], mlflow_name(key)), key=lambda m: m.timestamp)
        out[key] = [(m.step, m.value) for m in history]
    return out


@pytest.fixture
def file_store(monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def test_mlflow_holds_metrics_jsonl_and_the_flattened_config(tmp_path, file_store):
    from mlflow.tracking import MlflowClient

    cfg = _cfg(tmp_path, "[console,jsonl,mlflow]", "trainer.mlflow.experiment_name=tracked")
    run_dir = tmp_path / "track"
    _log(cfg, run_dir, STEPS)
    expected = _jsonl_series(run_dir)
    assert expected["val/openai/gsm8k/pass@4"] == [(1, 0.25), (3, 0.5)]
    assert _mlflow_series(run_dir, expected) == expected
    state = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert state["tracking_uri"] == (run_dir / "mlruns").resolve().as_uri()  # the default store
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    run = client.get_run(state["run_id"])
    assert run.info.run_name == "track" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "tracked"
    params = run.data.params
    assert params == flat_params(to_dict(cfg))
    assert params["actor.optim.lr"] == str(cfg.actor.optim.lr)
    assert params["trainer.loggers"] == "['console', 'jsonl', 'mlflow']"
    saved = client.download_artifacts(state["run_id"], "config.yaml", str(tmp_path / "artifact"))
    assert Path(saved).read_text() == dump(cfg)


def test_mlflow_param_values_are_cut_to_its_limit(file_store):
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    params = flat_params({"data": {"train_files": ["x" * 50] * 1000, "n": 3}})
    assert params["data.n"] == "3"
    assert len(params["data.train_files"]) == MAX_PARAM_VAL_LENGTH


def test_mlflow_resumed_run_continues_the_same_run(tmp_path, file_store):
    """A run killed after step 3 with its checkpoint at 2: the resumed run logs 3 and 4 into the
    same MLflow run, which keeps the killed run's step 3 beside the new one (MLflow cannot delete
    a logged point); metrics.jsonl has only the resumed run's."""
    cfg = _cfg(tmp_path, "[console,jsonl,mlflow]")
    run_dir = tmp_path / "track"
    _log(cfg, run_dir, STEPS, failed=True)
    first = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    assert client.get_run(first).info.status == "FAILED"
    _log(cfg, run_dir, {3: {"reward/mean": 0.75}, 4: {"reward/mean": 1.0}}, resume_step=2)
    state = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert state["run_id"] == first
    assert _jsonl_series(run_dir)["reward/mean"] == [(1, 0.125), (2, 0.25), (3, 0.75), (4, 1.0)]
    assert _mlflow_series(run_dir, ["reward/mean"])["reward/mean"] == [
        (1, 0.125),
        (2, 0.25),
        (3, 0.5),
        (3, 0.75),
        (4, 1.0),
    ]
    run = client.get_run(first)
    assert run.data.tags["megarl.resumed_after_step"] == "2" and run.info.status == "FINISHED"


def test_wandb_offline_holds_metrics_jsonl_and_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, "[console,jsonl,wandb]", "trainer.wandb.tags=[grpo,cpu]")
    run_dir = tmp_path / "track"
    _log(cfg, run_dir, STEPS)
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / f"run-{run_id}.wandb"))
    logged = {}
    for step, metrics in _wandb_log.history(Path(path)):
        for key, value in metrics.items():
            logged.setdefault(key, []).append((step, value))
    assert logged == _jsonl_series(run_dir)
    config = _wandb_log.config(Path(path))
    assert {k: v for k, v in config.items() if k != "_wandb"} == to_dict(cfg)
    records = _wandb_log.records(Path(path))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.run_id, run.display_name, run.project, list(run.tags)) == (run_id, "track", "megarl", ["grpo", "cpu"])

    # resumed after step 2: the same wandb run id (offline, each start writes its own run file,
    # in a folder named by the start's second: the first one moved aside, as a later second would)
    first = Path(path).parent.rename(Path(path).parent.with_name(f"offline-run-first-{run_id}"))
    _log(cfg, run_dir, {3: {"reward/mean": 0.75}}, resume_step=2)
    assert json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"] == run_id
    (second,) = glob.glob(str(run_dir / "wandb" / "offline-run-2*" / f"run-{run_id}.wandb"))
    assert _wandb_log.run_id(Path(second)) == run_id
    assert _wandb_log.history(Path(second)) == [(3, {"reward/mean": 0.75})]
    assert len(_wandb_log.history(first / Path(path).name)) == 3


@pytest.mark.parametrize(
    ("name", "install"),
    [
        ("wandb", "pip install 'megarl[wandb]' (or pip install wandb==0.31.0)"),
        ("mlflow", "pip install 'megarl[mlflow]' (or pip install mlflow-skinny==3.17.2)"),
    ],
)
def test_a_tracker_not_installed_is_refused_with_its_install_line(name, install, monkeypatch, capsys):
    """By `train`'s validation (show-config runs the same and starts nothing, whatever happens) and
    by `sft`'s."""
    from megarl.cli import main
    from megarl.config.validate_sft import validate_sft

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a))
    code = main(["show-config", str(ROOT / "configs/quickstart.yaml"), f"trainer.loggers=[console,jsonl,{name}]"])
    assert (code, capsys.readouterr().err) == (
        2,
        f"megarl: config error: trainer.loggers: {name} is not installed; {install}\n",
    )
    sft = load_config(ROOT / "configs/sft-quickstart.yaml", [f"trainer.loggers=[console,jsonl,{name}]"])
    with pytest.raises(ConfigError, match=f"^trainer.loggers: {name} is not installed; {re.escape(install)}$"):
        validate_sft(sft)


def test_the_old_tensorboard_key_names_its_replacement(tmp_path, capsys):
    from megarl.cli import main

    old = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    del old["trainer"]["loggers"]
    old["trainer"]["tensorboard"] = True
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    for argv in (
        ["show-config", str(tmp_path / "old.yaml")],
        ["show-config", str(ROOT / "configs/quickstart.yaml"), "trainer.tensorboard=false"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("megarl: config error: trainer.tensorboard was replaced by trainer.loggers; ")
        assert "trainer.loggers=[console,jsonl,tensorboard]" in err and err.count("\n") == 1


def test_loggers_without_jsonl_or_twice_are_refused(tmp_path):
    from megarl.config.validate_trackers import check_loggers

    with pytest.raises(ConfigError, match=r"leaves out jsonl.*trainer.loggers=\[jsonl,console,wandb\]"):
        check_loggers(_cfg(tmp_path, "[console,wandb]"))
    with pytest.raises(ConfigError, match="names console twice"):
        check_loggers(_cfg(tmp_path, "[console,jsonl,console]"))
    with pytest.raises(ConfigError, match="must be one of"):
        _cfg(tmp_path, "[console,jsonl,neptune]")


def test_console_off_writes_no_step_lines(tmp_path):
    shown, silent = io.StringIO(), io.StringIO()
    for stream, console in ((shown, True), (silent, False)):
        logger = MetricsLogger(None, 1, stream=stream, console=console)
        logger.log(1, {"reward/mean": 0.5})
        logger.note("checkpoint saved")
        logger.close()
    assert shown.getvalue().startswith("step 1/1 | reward 0.500")
    assert silent.getvalue() == "megarl: checkpoint saved\n"
