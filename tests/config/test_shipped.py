"""Shipped configs by name (megarl/config/shipped.py): `megarl train quickstart` from any directory,
their configs/... paths found from there, every other path left to the working directory."""

from pathlib import Path

import pytest

from megarl.cli import main
from megarl.config import ConfigError, load_config
from megarl.config.shipped import shipped_dir, shipped_names

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
SFT_TRAIN = "configs/data/sft-arith-tool-train.jsonl"


def test_in_a_clone_the_shipped_configs_are_the_repository_configs_folder():
    assert shipped_dir().resolve() == CONFIGS
    assert shipped_names() == sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert {"quickstart", "sft-quickstart", "deepseek-v3-671b"} <= set(shipped_names())


def test_a_bare_name_loads_the_shipped_file_from_any_directory(tmp_path, monkeypatch):
    by_path = load_config(CONFIGS / "quickstart.yaml", ["trainer.total_steps=7"])
    monkeypatch.chdir(tmp_path)
    assert load_config("quickstart", ["trainer.total_steps=7"]) == by_path
    assert load_config(str(CONFIGS / "quickstart.yaml")) == load_config("quickstart")  # a path still works


def test_an_unknown_name_is_refused_listing_the_shipped_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config("quickstrat")
    message = str(err.value)
    assert message.startswith("config: 'quickstrat' is neither a file nor a shipped config")
    assert message.endswith(", ".join(shipped_names()))
    with pytest.raises(ConfigError, match="config file configs/quickstrat.yaml does not exist"):
        load_config("configs/quickstrat.yaml")  # a path is not looked up by name


def test_cli_unknown_name_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["show-config", "no-such-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert (
        err.startswith("megarl: config error: config: 'no-such-config' is neither a file") and "sft-quickstart" in err
    )


def test_a_file_in_the_working_directory_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart").write_text("trainer:\n  total_steps: 3\n")
    assert load_config("quickstart").trainer.total_steps == 3


def test_shipped_data_paths_resolve_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert load_config("sft-quickstart").sft.train_files == SFT_TRAIN  # from the clone: as written
    monkeypatch.chdir(tmp_path)
    cfg = load_config("sft-quickstart")
    assert cfg.sft.train_files == str(CONFIGS / "data" / "sft-arith-tool-train.jsonl")
    assert cfg.sft.val_files == str(CONFIGS / "data" / "sft-arith-tool-val.jsonl")
    assert load_config("deepseek-v3-671b").model.path == str(CONFIGS / "models" / "deepseek-v3")
    assert load_config("agent-arith-tool").model.path == "outputs/agent-arith-tool-sft/hf"  # a run's output: cwd's
    # an override is the user's path, relative to where they are
    assert load_config("sft-quickstart", [f"sft.train_files={SFT_TRAIN}"]).sft.train_files == SFT_TRAIN


def test_a_configs_path_in_a_users_config_stays_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"sft:\n  train_files: [{SFT_TRAIN}]\n")
    assert load_config(mine).sft.train_files == [SFT_TRAIN]


def test_a_shipped_path_that_names_nothing_is_left_for_validation_to_report(tmp_path, monkeypatch):
    from megarl.config.shipped import anchor_shipped_paths

    monkeypatch.chdir(tmp_path)
    data = {"data": {"train_files": ["configs/data/nothing.jsonl", SFT_TRAIN]}, "model": {"path": None}}
    anchored = anchor_shipped_paths(data)
    assert anchored["data"]["train_files"] == ["configs/data/nothing.jsonl", str(CONFIGS / SFT_TRAIN[8:])]
    assert anchored["model"]["path"] is None
