"""A run's durable state: saving it to a checkpoint, continuing from one, exporting the policy.

The checkpoint holds the actor (and critic, and PRIME's PRM) with their optimizers and RNG (and
the reference when it is refreshed from the actor), the step, the weight
version, the data position, the adaptive KL coefficient, the model reward's normalisation
statistics and the controller's RNG; a resumed run
loads them, pushes the weights to the engines and continues with the next step's batch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from megarl.config.loader import dump
from megarl.data.mix import data_mix_identity
from megarl.trainer import status
from megarl.trainer.checkpoints import ResumeRefused, driver_rng_state, set_driver_rng_state

if TYPE_CHECKING:
    from megarl.config.schema import RunConfig
    from megarl.trainer.checkpoints import RunCheckpointer
    from megarl.trainer.metrics import MetricsLogger
    from megarl.trainer.runtime import Runtime


class DurableLoop(Protocol):
    """What a checkpoint saves of the loop and restores into it."""

    rt: Runtime
    cfg: RunConfig
    logger: MetricsLogger
    checkpointer: RunCheckpointer
    start_step: int
    weight_version: int
    actor_version: int
    data_cursor: int
    kl_ctrl: Any  # the adaptive KL controller (algo/kl.py), None without KL in the reward
    scorer: Any  # reward/model.RowScorer (None in an SFT run): its normalizer's statistics are saved
    last_checkpoint: Any
    _carried: dict[str, float]

    def sync_weights(self) -> dict: ...
    def _data_identity(self) -> dict: ...  # what a resumed run's data must equal (data_identity)


def save(loop: DurableLoop, step: int, data_position: int) -> None:
    """A checkpoint of the run: actor (and critic) with optimizers, the step, weight version, data
    position (the first prompt batch not trained on; the rollout source says which), adaptive KL
    coefficient and the controller's RNG (RunCheckpointer)."""
    start = time.perf_counter()
    with status.phase("save checkpoint"):
        partial = loop.checkpointer.begin(step)
        # a reference refreshed from the actor (ref.update_every) is saved beside it
        ref_path = str(partial / "ref") if loop.cfg.ref.update_every else None
        loop.rt.actor.save_checkpoint(str(partial / "actor"), ref_path=ref_path)
        if loop.rt.critic is not None:
            loop.rt.critic.save_checkpoint(str(partial / "critic"))
        if loop.rt.prm is not None:  # PRIME's implicit PRM, with its optimizer
            loop.rt.prm.save_checkpoint(str(partial / "prm"))
        state = {
            "weight_version": loop.weight_version,
            "data": loop._data_identity(),
            "data_cursor": data_position,
            "kl_coef": loop.kl_ctrl.value if loop.kl_ctrl is not None else None,
            "reward_norm": loop.scorer.normalizer.state_dict() if loop.scorer is not None else None,
            "driver_rng": driver_rng_state(),
            "model_path": loop.rt.model_path,
        }
        loop.last_checkpoint = loop.checkpointer.commit(step, partial, state, dump(loop.cfg))
    loop._carried["perf/checkpoint_save_s"] = time.perf_counter() - start
    loop.logger.note(f"saved checkpoint {loop.last_checkpoint} ({loop._carried['perf/checkpoint_save_s']:.1f} s)")


def restore(loop: DurableLoop, path, state: dict) -> None:
    """Continue after the checkpoint at `path`: policy (and critic) with their optimizers and
    RNG, the controller's RNG, the weight version; the engines get the checkpoint's weights."""
    if state["data"] != loop._data_identity():
        raise ResumeRefused(
            f"{path} was saved by a run whose data was {state['data']}, this run's is "
            f"{loop._data_identity()}: its batches would not continue where that run stopped. "
            "Restore those data settings, or start a new run (trainer.experiment_name)"
        )
    start = time.perf_counter()
    ref_path = None
    if loop.cfg.ref.update_every:
        if not (path / "ref").is_dir():
            raise ResumeRefused(
                f"{path} holds no ref/ (saved by a run whose reference was never refreshed); resume it "
                "with ref.update_every=0, or start a new run"
            )
        ref_path = str(path / "ref")
    loop.rt.actor.load_checkpoint(str(path / "actor"), ref_path=ref_path)
    if loop.rt.critic is not None:
        if not (path / "critic").is_dir():
            raise ResumeRefused(
                f"{path} holds no critic/ (saved by a run without critic.enabled); resume it with critic.enabled=false"
            )
        loop.rt.critic.load_checkpoint(str(path / "critic"))
    if loop.rt.prm is not None:
        if not (path / "prm").is_dir():
            raise ResumeRefused(
                f"{path} holds no prm/ (saved by a run with another algorithm.adv_estimator than prime); "
                "resume it with the estimator it was saved with, or start a new run"
            )
        loop.rt.prm.load_checkpoint(str(path / "prm"))
    set_driver_rng_state(state["driver_rng"])
    loop.start_step, loop.weight_version = int(state["step"]), int(state["weight_version"])
    loop.actor_version = loop.weight_version
    loop.data_cursor = int(state.get("data_cursor", loop.start_step))
    if loop.kl_ctrl is not None and state.get("kl_coef") is not None:
        loop.kl_ctrl.value = float(state["kl_coef"])
    if loop.scorer is not None and state.get("reward_norm") is not None:
        loop.scorer.normalizer.load_state_dict(state["reward_norm"])
    loop.sync_weights()  # the engines still hold the initial model (an SFT run has none)
    loop.logger.note(
        f"resumed from {path} (step {loop.start_step}, weight version "
        f"{loop.weight_version}) in {time.perf_counter() - start:.1f} s"
    )


def export_hf(loop: DurableLoop) -> None:
    """The policy as a Hugging Face folder, RUN_DIR/hf."""
    out = loop.rt.run_dir / "hf"
    info = loop.rt.actor.export_hf(str(out), loop.rt.model_path)
    loop.logger.note(
        f"exported the policy as a Hugging Face model: {out} "
        f"({info['tensors']} tensors, {info['bytes'] / 2**20:.1f} MiB)"
    )
    if loop.cfg.actor.lora.rank:  # and its adapters alone, as PEFT loads them onto the base
        out = loop.rt.run_dir / "lora"
        info = loop.rt.actor.export_lora(str(out))
        loop.logger.note(f"exported the LoRA adapters as a PEFT folder: {out} ({info['bytes'] / 2**20:.2f} MiB)")


def data_identity(loop: DurableLoop) -> dict:
    """What a resumed RL run's data must equal for its batches to continue where the saved run's stopped."""
    d = loop.cfg.data
    return {
        "prompts": len(loop.rt.train_data),
        "train_batch_size": d.train_batch_size,
        "shuffle": d.shuffle,
        "seed": d.seed,
        **data_mix_identity(loop.rt.train_data),
    }
