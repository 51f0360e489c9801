"""The actor's (or critic's) optimizer: Megatron's Adam, its state and step on the device, on the
host (actor.offload.host_optimizer = 1: CPU Adam, as verl runs DeepSeek-V3 671B), or split.

Host Adam is Megatron's HybridDeviceOptimizer: it keeps fp32 master weights, both moments and
the update of the chosen share of parameters in host memory, copies their gradients device ->
host before the step and the updated weights host -> device after it. Megatron pairs it with its
precision-aware distributed optimizer, so the device keeps no fp32 master weights of its own
(the hybrid one holds them, on the host for the offloaded share).
"""

from __future__ import annotations

import torch

from megarl.config.schema import OptimConfig


def host_optimizer_args(fraction: float) -> dict:
    """OptimizerConfig's fields for keeping `fraction` of the optimizer on the host (0: none)."""
    if fraction <= 0:
        return {}
    on_gpu = torch.cuda.is_available()
    return dict(
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=fraction,
        # the hybrid optimizer owns the fp32 master weights (Megatron-LM requires this pairing)
        use_precision_aware_optimizer=True,
        # one CPU Adam per parameter, its copies on side streams: the transfer of one parameter
        # overlaps the update of the previous
        overlap_cpu_optimizer_d2h_h2d=on_gpu,
        pin_cpu_grads=on_gpu,  # pinned host memory needs a device to pin against
        pin_cpu_params=on_gpu,
    )


def build_optimizer(o: OptimConfig, params_dtype: torch.dtype, chunks: list, host_fraction: float = 0.0):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        # bf16: Megatron keeps fp32 master copies of the bf16 parameters in the optimizer
        bf16=params_dtype is torch.bfloat16,
        fp16=False,
        params_dtype=params_dtype,
        use_distributed_optimizer=o.use_distributed_optimizer,
        **host_optimizer_args(host_fraction),
    )
    return get_megatron_optimizer(config, chunks)
