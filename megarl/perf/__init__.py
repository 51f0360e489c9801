"""Performance accounting: FLOPs of a model from its HF config and device peaks, for MFU and planning.

Pure functions; nothing here imports Megatron (torch only for the CPU microbenchmark and GPU names).
"""

from megarl.perf.flops import count_params, forward_flops, generation_flops, param_counts, train_flops
from megarl.perf.peak import PEAK_TFLOPS, device_peak_flops, mfu

__all__ = [
    "PEAK_TFLOPS",
    "count_params",
    "device_peak_flops",
    "forward_flops",
    "generation_flops",
    "mfu",
    "param_counts",
    "train_flops",
]
