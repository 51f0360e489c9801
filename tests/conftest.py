import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# Spawned test processes import `tests._dist` and `megarl` from the repo root.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A random-init tiny Qwen3-MoE HF checkpoint shared by the whole session (read-only)."""
    from megarl.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-qwen3-moe", seed=0)


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory) -> str:
    """A random-init tiny Qwen2.5-VL HF checkpoint shared by the whole session (read-only)."""
    from megarl.models.tiny_vlm import build_tiny_vlm_checkpoint

    return str(build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vlm") / "tiny-qwen2.5-vl", seed=0))


# The slow tier: modules that start Ray clusters, Megatron ranks, TP engines or server processes,
# ~10 s to ~3 min each. `bash scripts/test.sh --quick` runs everything else; the whole suite (the
# README's test command and CI's) runs both.
SLOW_MODULES = {
    "tests/benchmarks/test_smoke.py",
    "tests/bridge/test_bridge.py",
    "tests/controller/test_multinode.py",
    "tests/controller/test_worker_group.py",
    "tests/engine/test_architectures.py",
    "tests/engine/test_checkpoint.py",
    "tests/engine/test_cpu_collectives.py",
    "tests/engine/test_host_optimizer.py",
    "tests/engine/test_critic.py",
    "tests/engine/test_logprob_engine.py",
    "tests/engine/test_lora.py",
    "tests/engine/test_megatron_engine.py",
    "tests/engine/test_vlm_engine.py",
    "tests/engine/test_recipes_engine.py",
    "tests/trainer/test_recipe_runs.py",
    "tests/rollout/client/test_manager_images.py",
    "tests/trainer/test_vlm_run.py",
    "tests/engine/test_output_head.py",
    "tests/engine/test_offload.py",
    "tests/engine/test_routing_replay.py",
    "tests/engine/test_sft_loss.py",
    "tests/engine/test_vlm.py",
    "tests/entry/test_checkpoint_convert.py",
    "tests/entry/test_cli.py",
    "tests/entry/test_launch.py",
    "tests/models/test_smollm2.py",
    "tests/reward/test_classifier_reward.py",
    "tests/rollout/client/test_rollout_client.py",
    "tests/rollout/engine/test_rollout_tp.py",
    "tests/rollout/engine/test_weight_receive.py",
    "tests/rollout/fleet/test_rollout_fleet.py",
    "tests/trainer/test_agent_runs.py",
    "tests/trainer/test_async_loops.py",
    "tests/trainer/test_crash.py",
    "tests/trainer/test_durability.py",
    "tests/trainer/test_lora_run.py",
    "tests/trainer/test_preemption_runs.py",
    "tests/trainer/test_reference_curve.py",
    "tests/trainer/test_reward_model_loop.py",
    "tests/trainer/test_sft.py",
    "tests/trainer/test_trainer_loop.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(item.fspath).relative_to(ROOT).as_posix() in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
