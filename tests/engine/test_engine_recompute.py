"""actor.recompute / critic.recompute: activation recompute saves memory and changes no number.

The independent reference is the same training step without recompute: one step (fp32, lr 1e-3,
Adam eps 1e-2 as in test_megatron_engine) with recompute=full and =selective must give its
gradient norm (1e-6 relative) and updated weights (1e-6 absolute; observed: bit-identical) on a MoE
model (tiny-qwen3-moe) and a dense one (tiny-qwen2). The recompute is shown to have happened:
every checkpointed function runs once without grad (the forward) and once more with grad (the
backward's recompute), and the checkpointed function is the whole layer (full) or core attention
(selective). All six engines share one gloo process to stay fast.
"""

from __future__ import annotations

import pytest
import torch

from megarl.config import ConfigError, load_config, validate
from megarl.models.tiny import TINY_QWEN3_MOE
from tests._dist import run_ranks
from tests.engine.test_megatron_engine import make_rows

PRESETS = ("tiny-qwen3-moe", "tiny-qwen2")
SETTINGS = ("none", "full", "selective")
# the function megatron checkpoints under each setting (its __qualname__ contains this)
CHECKPOINTED = {"full": "checkpointed_forward", "selective": "_checkpointed_attention_forward"}


def _one_step(model_path: str, recompute: str, calls: list) -> dict:
    from megarl.algo.losses import policy_loss
    from megarl.config.schema import OptimConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    engine = MegatronEngine(
        EngineSpec(
            model_path=model_path,
            micro_batch_size=2,
            seed=1,
            recompute=recompute,
            optim=OptimConfig(lr=1e-3, adam_eps=1e-2, clip_grad=0.0),
        )
    )
    engine.initialize()

    def loss_fn(logp, ent, mb):
        mask = mb["response_mask"]
        loss, _ = policy_loss(logp, logp.detach(), mb["advantages"], mask, global_denominator=1.0)
        return loss, mask.sum(), {}

    calls.clear()
    metrics = engine.train_mini_batch(make_rows(), loss_fn)
    return {
        "grad_norm": metrics["actor/grad_norm"],
        "weights": {k: v.clone() for k, v in engine.export_weights()},
        "granularity": engine.config.recompute_granularity,
        "calls": list(calls),
    }


def _all_settings(rank, paths: dict) -> dict:
    from megatron.core import tensor_parallel

    calls = []  # (qualname of the checkpointed function, grad enabled) per run of it
    original = tensor_parallel.checkpoint

    def counting_checkpoint(function, distribute_saved_activations, *args):
        def run(*inputs):
            calls.append((function.__qualname__, torch.is_grad_enabled()))
            return function(*inputs)

        return original(run, distribute_saved_activations, *args)

    tensor_parallel.checkpoint = counting_checkpoint  # looked up at call time by megatron
    return {
        (preset, setting): _one_step(str(paths[preset]), setting, calls) for preset in PRESETS for setting in SETTINGS
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_path):
    from megarl.models.tiny import build_tiny_checkpoint

    paths = {
        "tiny-qwen3-moe": tiny_model_path,
        "tiny-qwen2": build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2") / "m", seed=0, preset="tiny-qwen2"),
    }
    return run_ranks(_all_settings, 1, paths)[0]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("setting", ["full", "selective"])
def test_recompute_matches_no_recompute(results, preset, setting):
    base, got = results[(preset, "none")], results[(preset, setting)]
    assert got["granularity"] == setting and base["granularity"] is None
    assert base["calls"] == []
    names = {name for name, _ in got["calls"]}
    assert names and all(CHECKPOINTED[setting] in name for name in names), names
    forward = sum(not grad for _, grad in got["calls"])
    recomputed = sum(grad for _, grad in got["calls"])
    assert forward > 0 and recomputed == forward  # each checkpointed piece ran again in backward
    assert got["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-6)
    assert got["weights"].keys() == base["weights"].keys()
    for name, weight in base["weights"].items():
        torch.testing.assert_close(got["weights"][name], weight, atol=1e-6, rtol=0, msg=name)


def test_recompute_key_round_trips_through_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  recompute: full\n")
    cfg = validate(load_config(path, ["critic.recompute=selective"]), dict(TINY_QWEN3_MOE))
    assert (cfg.actor.recompute, cfg.critic.recompute) == ("full", "selective")
    assert validate(load_config(None, []), dict(TINY_QWEN3_MOE)).actor.recompute == "none"
    with pytest.raises(ConfigError, match=r"actor\.recompute.*must be one of"):
        load_config(path, ["actor.recompute=partial"])


def test_runtime_passes_recompute_to_the_engines():
    from megarl.trainer.runtime import critic_engine_spec, engine_spec

    cfg = load_config(None, ["actor.recompute=full", "critic.recompute=selective"])
    assert engine_spec(cfg, "m").recompute == "full"
    assert critic_engine_spec(cfg, "m").recompute == "selective"


@pytest.mark.parametrize(
    "name, recompute", [("deepseek-v3-671b", "full"), ("qwen3-235b-a22b", "full"), ("qwen3-30b-a3b", "full")]
)
def test_scale_configs_choose_recompute(name, recompute):
    from pathlib import Path

    config = Path(__file__).resolve().parents[2] / "configs" / f"{name}.yaml"
    assert load_config(config, []).actor.recompute == recompute
