"""The planner with actor.offload.host_optimizer: verl's DeepSeek-V3 671B layout on 96 H20 keeps
Adam on the host (Megatron's optimizer_offload_fraction 1.0); with it the layout fits, without it
the plan is refused and names the key.

Independent reference for the bytes: per parameter, Adam's device state in bf16 is 12 bytes
(fp32 master + two fp32 moments) and the host share holds 16 (those, and the fp32 gradient the
hybrid optimizer copies in), counted here from the model's stage split, not from the plan.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _verl_dsv3(*extra: str):
    from megarl.config.loader import load_config
    from megarl.config.validate import validate

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _published as published

    [run] = [r for r in published.load_runs() if r["id"] == "verl-dsv3-96xH20-grpo"]
    assert run["hardware"] == {"gpu": "H20", "count": 96, "gpus_per_node": 8}
    overrides, _prompt, response, _ = published.overrides(run)
    overrides = [o for o in overrides if not o.startswith("actor.offload.host_optimizer=")]  # the test sets it
    base = published.BASE_CONFIGS[run["model"]]
    cfg = validate(load_config(str(ROOT / "configs" / f"{base}.yaml"), [*overrides, *extra]))
    hf = json.loads((ROOT / cfg.model.path / "config.json").read_text())
    return cfg, hf, overrides, response


def _plan(*extra: str):
    from megarl.perf.hardware import parse_devices
    from megarl.perf.plan import make_plan, refusal

    cfg, hf, _, response = _verl_dsv3(*extra)
    _, device = parse_devices("96xH20")
    plan = make_plan(cfg, hf, device, mean_response=response, timed=False)
    return cfg, hf, plan, refusal(cfg, hf, plan)


def test_verl_dsv3_on_96_h20_fits_with_host_adam_and_is_refused_without():
    from megarl.perf.memory import stage_params

    cfg, hf, without, why = _plan()
    assert not without.fits and "train" in without.overflows()
    assert "set actor.offload.host_optimizer=1.0" in why, why
    cfg, hf, with_host, why = _plan("actor.offload.host_optimizer=1.0")
    assert with_host.fits and why is None
    # dp = 96 / (tp 8 * pp 12) = 1: nothing shards Adam's state; 12 bytes per parameter of the worst
    # stage leave the device, 16 per parameter of the largest stage land on the host of each rank
    stages = stage_params(hf, cfg.actor.parallel)
    worst = stages[without.train.stage]
    state = 12 * (worst.dense + worst.expert)
    assert without.phases["train"]["actor optimizer"] == pytest.approx(state, rel=1e-9)
    assert with_host.phases["train"]["actor optimizer"] == 0
    assert with_host.peak("train") == pytest.approx(without.peak("train") - state, rel=1e-9)
    most = max(s.dense + s.expert for s in stages)
    assert with_host.host["actor host optimizer"] == pytest.approx(8 * 16 * most, rel=1e-9)  # 8 ranks a node
    assert "actor host optimizer" not in without.host


def test_a_share_keeps_the_rest_of_the_optimizer_on_the_device():
    _, _, full, _ = _plan()
    _, _, half, _ = _plan("actor.offload.host_optimizer=0.5")
    device = full.phases["train"]["actor optimizer"]
    assert half.phases["train"]["actor optimizer"] == pytest.approx(device / 2, rel=1e-9)
    assert half.host["actor host optimizer"] > 0


def test_megarl_plan_prints_the_host_memory_per_node(capsys, monkeypatch):
    from megarl.cli import main

    monkeypatch.chdir(ROOT)
    _, _, overrides, _ = _verl_dsv3()
    args = ["plan", "configs/deepseek-v3-671b.yaml", *overrides]
    assert main([*args, "actor.offload.host_optimizer=1.0", "--devices", "96xH20"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "host memory per node" in x)
    assert "(8 ranks)" in line and "GiB" in line
    assert "actor host optimizer" in out
    assert main([*args, "--devices", "96xH20"]) == 2
    err = capsys.readouterr().err
    assert "set actor.offload.host_optimizer=1.0" in err
