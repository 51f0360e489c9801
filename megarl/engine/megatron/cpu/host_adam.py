"""Megatron's host optimizer (HybridDeviceOptimizer, actor.offload.host_optimizer) on CPU.

The hybrid optimizer decides which parameters it steps on the host by `param.is_cuda`: a device
parameter inside the offloaded share gets a host copy and a CPU Adam, the others stay with the
device Adam, and a parameter already on the host is assumed to have no device twin. On a CPU
machine every parameter is "on the host", so megatron files them all under its CPU Adam with no
twin, and the first step fails with a KeyError in `_set_sub_optimizer_grads`.

Here device memory is host memory; the split below treats the model's own parameters as the
device's, so the share the configuration names gets separate copies, its gradients copied in
and its updated weights copied back after the CPU Adam: the same path as on a GPU, with copies
between two places of one memory.

Checkpoints: without TransformerEngine megatron reads the step count from every parameter's
torch-Adam state, which a fresh optimizer (a run about to resume) has not created yet;
`zero_adam_state` creates it (compat.py's checkpoint fix, for torch's Adam and the hybrid's).
"""

from __future__ import annotations

import torch


def split_params(self, offload_fraction: float):
    """HybridDeviceOptimizer._get_sub_optimizer_param_groups where every parameter is the device's.

    Returns (host groups, device groups, device param -> host copy, host copy -> device param,
    param -> fp32 copy), walking the parameters in order and copying them to the host until the
    copied elements reach offload_fraction of all.
    """
    total = sum(p.numel() for group in self.param_groups for p in group["params"])
    threshold = total * offload_fraction
    copied = 0
    host_groups, device_groups = [], []
    to_host, to_device, to_fp32 = {}, {}, {}
    for group in self.param_groups:
        host, device = [], []
        for param in group["params"]:
            inner = param
            offload = copied < threshold
            if offload:
                inner = param.detach().clone()
                copied += param.numel()
            if self.param_update_in_fp32 and inner.dtype != torch.float32:
                inner = inner.detach().clone().float()
                to_fp32[param] = inner
            if offload:
                to_host[param], to_device[inner] = inner, param
            (host if offload else device).append(inner)
        for chosen, out in ((host, host_groups), (device, device_groups)):
            if chosen:
                out.append({**group, "params": chosen})
    return host_groups, device_groups, to_host, to_device, to_fp32


def materialise(hybrid) -> None:
    """Give every parameter of a fresh hybrid optimizer the state Adam would create at its first
    step (zero moments, step 0; fp32 master weights as they are), so a run about to resume can
    describe the state it loads: the hybrid counterpart of compat's torch-Adam fix, without the
    random-gradient `dummy_step` megatron's load path would take, which moves the weights."""
    for sub in hybrid.sub_optimizers:
        zero_adam_state(sub)
    hybrid._sync_sub_optimizers_state_to_hdo()


def zero_adam_state(adam: torch.optim.Optimizer) -> None:
    """What torch's Adam creates lazily at a parameter's first step, for those without state."""
    for group in adam.param_groups:
        for p in group["params"]:
            if not adam.state[p]:
                adam.state[p].update(
                    step=torch.zeros((), dtype=torch.float32),
                    exp_avg=torch.zeros_like(p),
                    exp_avg_sq=torch.zeros_like(p),
                )


def install() -> None:
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    HybridDeviceOptimizer._get_sub_optimizer_param_groups = split_params
