"""The building blocks several sections share: a model's parallel layout, its optimizer, what it
offloads and how it recomputes activations (the actor, critic and PRM sections each hold their own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Activation recompute (Megatron's; numbers unchanged: tests/engine/test_engine_recompute.py). "none"
# keeps every activation; "selective" recomputes core attention (no [s, s] scores kept, a few % more
# compute); "full" keeps each layer's input and recomputes the layer in backward (granularity full,
# method uniform, 1 layer per unit): least memory, ~+33% compute. MFU counts model FLOPs (trainer/mfu.py).
Recompute = Literal["none", "selective", "full"]


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    ep: int = 1  # expert parallel
    etp: int = 1  # expert tensor parallel
    cp: int = 1  # context parallel
    vpp: int = 1  # virtual pipeline stages per pp rank (interleaved 1F1B)
    # uneven pipelines (Megatron's num_layers_in_first/last_pipeline_stage): layers of the first /
    # last stage; the rest split evenly over the middle stages. None: an even split. DeepSeek-V3's
    # 61 layers (a prime) need it for any pp other than 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    sequence_parallel: bool | None = None  # None: on when tp > 1


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # max global grad norm; 0 disables clipping
    use_distributed_optimizer: bool = True


@dataclass
class OffloadConfig:
    """What leaves the device between calls (colocation): host memory, pinned on GPU machines.
    Parameters come back for every forward, gradients and optimizer state only for updates."""

    params: bool = False
    grads: bool = False
    optimizer: bool = False
    host_optimizer: float = 0.0  # share of Adam's state and step kept and run on the host (CPU Adam)
