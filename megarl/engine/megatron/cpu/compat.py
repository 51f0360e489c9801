"""Run megatron-core on CPU over gloo.

megatron-core assumes CUDA in a few dozen places. Rather than forking call sites, this module
patches those places once, and only when CUDA is absent (`activate()` is a no-op on a GPU
machine). Each patch names the failure it fixes, so it can be dropped when megatron stops
needing it. Measured against megatron-core 0.19.2 + torch 2.13 CPU.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from megarl.engine.megatron.cpu import collectives as cpu_collectives
from megarl.engine.megatron.cpu import host_adam

_ACTIVE = False
_LOCK = threading.Lock()


def needed() -> bool:
    return not torch.cuda.is_available()


def activate() -> bool:
    """Install the CPU patches if CUDA is absent. Idempotent. Returns whether they are active.

    The patches are process-wide (every thread, once); call it before any megatron code runs.
    """
    global _ACTIVE
    if not needed():
        return False
    with _LOCK:
        if not _ACTIVE:
            _patch_torch_cuda()
            _patch_cuda_placement()
            _patch_rng()
            _patch_torch_norm()
            _patch_moe_splits()
            _patch_torch_adam_checkpoints()
            host_adam.install()  # actor.offload.host_optimizer: which parameters Adam steps on the host
            cpu_collectives.install()  # ranks on one host: hot collectives through shared memory
            _ACTIVE = True
    return True


def import_megatron() -> None:
    """Import megatron-core without torch.compile when CUDA is absent (before anything else does).

    megatron decorates its fusions with `jit_fuser = torch.compile` at import time, which imports
    torch._dynamo and torch._inductor: 5 of a rank's 14 s of imports on a 2-core host, twice
    per start-up (two ranks). On CPU the decorated functions run eagerly instead: the fusions are
    off in the CPU config anyway (model.py), and the few helpers that use the decorator too (the
    router's expert-bias update, L2Norm) compute the same in eager mode (the quickstart's curve is
    bit-identical; DeepSeek-V3's expert bias is covered by the architecture tests).
    """
    import importlib
    import sys

    if not needed() or "megatron.core" in sys.modules:
        return
    compile_fn = torch.compile
    torch.compile = lambda model=None, **_: model if model is not None else (lambda fn: fn)
    try:
        importlib.import_module("megatron.core")
    finally:
        torch.compile = compile_fn


# --------------------------------------------------------------------------------------------
# Hard-coded placement: megatron writes `device="cuda"`, `.cuda()` and `pin_memory=True` in ~34
# places on the paths we use (causal masks in transformer/utils.py, schedules.py,
# get_batch_on_this_cp_rank, MoE token counts, DDP buffers...), each failing with "Torch not
# compiled with CUDA enabled". Rather than 34 call-site patches that would go stale with every
# megatron release, the functions those sites call send CUDA placements to the CPU: the tensor
# factories (a `device=` or `pin_memory=` argument), `Tensor.to/.cuda/.pin_memory/.new_*`, and
# `Tensor.type()`, which DDP and the optimizers compare with 'torch.cuda.FloatTensor'.
#
# An earlier version used one TorchFunctionMode, which saw every torch call: ~5 us of Python per
# op, 19% of an actor's CPU time in the quickstart (py-spy). These wrappers run only on the calls
# that can carry a device: no other op pays anything.

_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
    "empty_strided",
    "linspace",
    "logspace",
    "eye",
    "tril_indices",
    "triu_indices",
)
_NEW_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_kwargs(kwargs: dict) -> dict:
    if "device" in kwargs and _is_cuda(kwargs["device"]):
        kwargs["device"] = "cpu"
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


def _redirect_factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        return fn(*args, **_cpu_kwargs(kwargs)) if kwargs else fn(*args)

    factory.__megarl_cpu__ = fn
    return factory


def _patch_cuda_placement():
    for name in _FACTORIES:
        setattr(torch, name, _redirect_factory(getattr(torch, name)))
    for name in _NEW_METHODS:
        setattr(torch.Tensor, name, _redirect_factory(getattr(torch.Tensor, name)))

    to, tensor_type = torch.Tensor.to, torch.Tensor.type

    def to_cpu(self, *args, **kwargs):
        if args and _is_cuda(args[0]):
            args = ("cpu", *args[1:])
        return to(self, *args, **_cpu_kwargs(kwargs)) if kwargs else to(self, *args)

    def cuda_type(self, *args, **kwargs):
        if not args and not kwargs:  # DDP / optimizers: param.type() == 'torch.cuda.FloatTensor'
            return tensor_type(self).replace("torch.", "torch.cuda.", 1)
        return tensor_type(self, *args, **kwargs)

    torch.Tensor.to = to_cpu
    torch.Tensor.type = cuda_type
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


# --------------------------------------------------------------------------------------------
# torch.cuda: device queries, streams and events used for overlap that CPU does not have.


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: CPU work is ordered already, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def record_event(self, *args):
        return _NullStream()

    def record(self, *args):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *args):
        pass


def _patch_torch_cuda():
    # `device=torch.cuda.current_device()` appears in buffer allocations (DDP grad buffers,
    # MoE token dispatch): "Torch not compiled with CUDA enabled" -> allocate on CPU instead.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullStream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.empty_cache = lambda: None


# --------------------------------------------------------------------------------------------
# RNG: model_parallel_cuda_manual_seed asserts on CUDA generators; keep named CPU RNG states.


class CpuRNGStatesTracker:
    """CPU twin of megatron's CudaRNGStatesTracker: named generator states forked on demand."""

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()
        self._is_initialized = False

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _patch_rng():
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom.initialize_rng_tracker = lambda *a, **k: None
    mrandom.get_cuda_rng_tracker = lambda *a, **k: mrandom._CUDA_RNG_STATE_TRACKER
    torch.cuda.manual_seed = torch.manual_seed
    # Activation recompute (CheckpointFunction, actor.recompute) saves the CUDA generator beside the
    # CPU one and the tracker's: "Torch not compiled with CUDA enabled". A CPU process has no device
    # generator; its CPU state is saved and restored next to it already.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *a, **k: None


# --------------------------------------------------------------------------------------------
# Norms: megatron's torch-norm wrapper asserts "sequence parallel not supported by torch
# LayerNorm" (TE's norms are the SP-aware ones). Under SP each TP rank normalises different tokens
# with replicated weights; marking the weights `sequence_parallel` makes finalize_model_grads
# all-reduce their gradients across TP, which is all TE does differently.


def _patch_torch_norm():
    from megatron.core.transformer import torch_norm

    def _new(
        cls,
        config,
        hidden_size,
        eps=1e-5,
        persist_layer_norm=False,
        zero_centered_gamma=False,
        normalization="LayerNorm",
    ):
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma needs TransformerEngine norms")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization={config.normalization!r} is not supported on CPU")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = _new


# --------------------------------------------------------------------------------------------
# MoE all-to-all: the alltoall dispatcher turns split sizes into numpy via
# moe_utils.maybe_move_tensor_to_cpu, but only for CUDA tensors; on CPU they stay tensors and
# gloo's all_to_all_single rejects them ("incompatible function arguments").


def _patch_moe_splits():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = to_host
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


# --------------------------------------------------------------------------------------------
# Checkpoints of the distributed optimizer around torch.optim.Adam. Without TransformerEngine or
# apex megatron's DistributedOptimizer wraps torch's Adam, which keeps a `step` TENSOR in every
# parameter's state (FusedAdam keeps it in the param groups), and megatron's checkpoint code
# trips over it three times (checkpoint.py saves and loads through these paths):


def _patch_torch_adam_checkpoints():
    from megatron.core.optimizer import distrib_optimizer as dopt
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    if dopt.HAVE_APEX_OR_TE:
        return
    cls = dopt.DistributedOptimizer
    state_dict, load_state_dict, set_states = (
        cls.state_dict,
        cls.load_state_dict,
        cls._set_main_param_and_optimizer_states,
    )

    def materialised_state_dict(self):
        # `assert len(steps) == 1`: torch's Adam creates its state lazily at the first step, so a
        # fresh optimizer (a run about to resume) cannot describe the state it wants to load.
        # Create what Adam would create itself (zero moments, step 0); the next step is unchanged.
        inner = self.optimizer
        if isinstance(inner, HybridDeviceOptimizer):  # host Adam: torch Adams inside
            host_adam.materialise(inner)
            return state_dict(self)
        if isinstance(inner, torch.optim.Adam):  # AdamW included; other optimizers untouched
            host_adam.zero_adam_state(inner)
        return state_dict(self)

    def unshared_load_state_dict(self, state):
        # load_state_dict gives every parameter the SAME step tensor, and Adam increments each
        # parameter's step in place: the next step would count once per parameter (a silently
        # wrong bias correction). Give every parameter its own copy.
        load_state_dict(self, state)
        for param_state in self.optimizer.state.values():
            if torch.is_tensor(param_state.get("step")):
                param_state["step"] = param_state["step"].clone()

    def set_states_without_step(self, model_param, tensors):
        # KeyError: 'step': the reshardable loaders skip the step (it comes from the param
        # groups) but this copies every tensor of the parameter's state, the step included.
        group_index, group_order = self.model_param_group_index_map[model_param]
        param_state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = param_state.pop("step", None)
        try:
            set_states(self, model_param, tensors)
        finally:
            if step is not None:
                param_state["step"] = step

    cls.state_dict = materialised_state_dict
    cls.load_state_dict = unshared_load_state_dict
    cls._set_main_param_and_optimizer_states = set_states_without_step


def seed_model_parallel(seed: int) -> None:
    """Seed every RNG megatron uses (CPU or CUDA) for this rank's place in the mesh."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
