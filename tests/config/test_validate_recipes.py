"""The recipes' configs (megarl/config/validate_recipes.py): the three shipped ones validate and
resolve what they need (the reference on, SPIN's old log-probs recomputed); what they do not run
with is refused by key."""

from __future__ import annotations

import pytest

from megarl.config.loader import ConfigError, load_config
from megarl.config.validate import validate

SPIN, SPPO, PRIME = (f"configs/quickstart-{name}.yaml" for name in ("spin", "sppo", "prime"))


def test_the_shipped_recipes_validate_and_resolve_what_they_need():
    spin, sppo, prime = (validate(load_config(path)) for path in (SPIN, SPPO, PRIME))
    assert spin.ref.enabled and sppo.ref.enabled and prime.ref.enabled  # auto: each reads the reference
    assert spin.actor.old_log_prob == "recompute"  # the chosen rows were not sampled
    assert sppo.actor.old_log_prob == "rollout"  # sync, embedded, fp32: the engine's are the actor's
    assert prime.prm.parallel.sequence_parallel is False
    plain = validate(load_config("configs/quickstart.yaml"))
    assert plain.ref.enabled is False


REFUSED = [
    (SPIN, ["actor.use_kl_loss=true"], "actor.use_kl_loss", "log-ratio to the reference"),
    (SPIN, ["actor.entropy_coeff=0.01"], "actor.entropy_coeff", "no token bonus"),
    (SPIN, ["ref.enabled=false"], "ref.update_every", "ref.enabled=false"),
    (SPIN, ["ref.enabled=false", "ref.update_every=0"], "ref.enabled", "trains against the reference"),
    (SPIN, ["data.train_batch_size=15", "actor.ppo_mini_batch_size=120"], "data.train_batch_size", "whole prompts"),
    (SPIN, ["actor.old_log_prob=rollout"], "actor.old_log_prob", "no rollout log-probs"),
    (SPIN, ["algorithm.filter_groups.enable=true"], "algorithm.filter_groups.enable", "not generated"),
    (SPIN, ["trainer.mode=one_step_off", "cluster.placement=disaggregated"], "trainer.mode", "sync"),
    (SPIN, ["actor.lora.rank=8"], "ref.update_every", "frozen base"),
    (SPPO, ["algorithm.adv_estimator=grpo"], "algorithm.adv_estimator", "set both to sppo"),
    (SPPO, ["actor.policy_loss=vanilla"], "actor.policy_loss", "set both to sppo"),
    (SPPO, ["ref.update_every=-1"], "ref.update_every", ">= 0"),
    (PRIME, ["ref.update_every=5"], "ref.update_every", "initial policy"),
    (PRIME, ["algorithm.prime.accuracy_band=[0.8,0.2]"], "algorithm.prime.accuracy_band", "low <= high"),
    (
        PRIME,
        ["algorithm.prime.accuracy_band=[0.2,0.8]", "algorithm.filter_groups.enable=true"],
        "algorithm.filter_groups.enable",
        "one filter",
    ),
    (PRIME, ["prm.mini_batch_size=100"], "prm.mini_batch_size", "must divide"),
    (PRIME, ["prm.parallel.tp=3"], "prm.parallel", "prm"),
    (PRIME, ["algorithm.prime.beta=0"], "algorithm.prime.beta", "> 0"),
]


@pytest.mark.parametrize("path, overrides, key, fragment", REFUSED)
def test_what_a_recipe_does_not_run_with_is_refused(path, overrides, key, fragment):
    with pytest.raises(ConfigError) as info:
        validate(load_config(path, overrides))
    message = str(info.value)
    assert info.value.key == key and fragment in message, message
    assert "\n" not in message


def test_a_recipe_refuses_a_vision_language_model():
    from megarl.models.tiny_vlm import hf_config

    with pytest.raises(ConfigError) as info:
        validate(load_config(SPPO, ["actor.parallel.ep=1"]), hf_config().to_dict())
    assert info.value.key == "actor.policy_loss" and "vision-language" in str(info.value)
