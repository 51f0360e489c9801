"""MFU of a step's phases: the model FLOPs of what the step computed / (time x devices x peak).

FLOPs come from the HF config (megarl/perf/flops.py) over the rows' real token counts (packed
sequences: no padding FLOPs); the peak per device from megarl/perf/peak.py (a GPU's datasheet
number for the training dtype; on CPU this host's own fp32 GEMM throughput at the ranks' one
thread each, measured once on actor rank 0 and cached). Model FLOPs, not hardware FLOPs:
recompute, padding and MoE imbalance earn nothing (MFU as PaLM defines it and Megatron and verl
report it): actor.recompute does not change the FLOPs counted here (train_flops' recompute stays
off), only the time, so a recomputing run shows a lower MFU for the same model work. Times are the controller's (a phase's RPC included): what a user waits for.
"""

from __future__ import annotations

import json
from pathlib import Path


class StepMfu:
    def __init__(self, hf_config: dict, devices: int, peak_flops: float, ppo_epochs: int = 1):
        self.config, self.devices, self.peak, self.epochs = hf_config, devices, peak_flops, ppo_epochs

    @classmethod
    def for_run(cls, model_path: str, actor_group, cfg, epochs: int | None = None) -> StepMfu:
        """`epochs`: passes over a step's rows in the update (None: actor.ppo_epochs; SFT: 1)."""
        from megarl.config.validate_vision import text_view

        # a vision-language model: its language model's flops (the vision tower's are not counted)
        config = text_view(json.loads((Path(model_path) / "config.json").read_text()))
        peak = actor_group.device_peak_flops("bf16" if cfg.actor.precision == "bf16" else "fp32")
        return cls(config, len(actor_group.mesh), peak, cfg.actor.ppo_epochs if epochs is None else epochs)

    def metrics(
        self, lengths: list[int], timing: dict[str, float], update_lengths: list[int] | None = None
    ) -> dict[str, float]:
        """perf/mfu/{update,log_prob,ref} and perf/tflops_per_device/... for the phases timed.
        `lengths`: the step's rows; `update_lengths`: the rows the update trained on where they
        are more (SPIN adds each prompt's chosen row), else the same."""
        from megarl.perf.flops import forward_flops, train_flops

        forward = forward_flops(self.config, lengths)
        trained = train_flops(self.config, lengths if update_lengths is None else update_lengths)
        phases = {
            "update": (trained * self.epochs, timing.get("perf/update_s")),
            "log_prob": (forward, timing.get("perf/old_log_prob_s")),
            "ref": (forward, timing.get("perf/ref_s")),
        }
        out = {}
        for name, (flops, seconds) in phases.items():
            if seconds:
                per_device = flops / seconds / self.devices
                out[f"perf/mfu/{name}"] = per_device / self.peak
                out[f"perf/tflops_per_device/{name}"] = per_device / 1e12
        return out
