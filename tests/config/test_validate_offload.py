"""Config validation of the host optimizer (actor.offload.host_optimizer, megarl/config/validate_offload.py):
each refusal names the key and the fix in one line."""

import pytest
import torch

from tests.config.test_config import test_bad_configs_name_the_key as _check

torch.set_num_threads(1)

HOST_OPTIMIZER_CONFIGS = [
    (["actor.offload.host_optimizer=1.5"], "actor.offload.host_optimizer", "=1.5 must be in [0, 1]"),
    (["actor.offload.host_optimizer=-0.1"], "actor.offload.host_optimizer", "must be in [0, 1]"),
    (["actor.offload.host_optimizer=1.0"], "actor.offload.host_optimizer", "needs actor.precision=bf16 (it is fp32)"),
    (
        ["actor.offload.host_optimizer=0.5", "actor.precision=bf16", "actor.optim.use_distributed_optimizer=false"],
        "actor.offload.host_optimizer",
        "needs actor.optim.use_distributed_optimizer=true",
    ),
    (["critic.offload.host_optimizer=0.5"], "critic.offload.host_optimizer", "the critic trains in fp32"),
    (["actor.offload.host_optimizer=1.0", "actor.precision=bf16"], None, None),
]


@pytest.mark.parametrize("overrides, key, fragment", HOST_OPTIMIZER_CONFIGS)
def test_host_optimizer_configs_name_the_key(overrides, key, fragment):
    _check(overrides, key, fragment)
