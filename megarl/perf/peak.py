"""Peak FLOP/s of a device, the denominator of MFU.

GPUs: vendor datasheet numbers (dense, i.e. without 2:4 structured sparsity, which datasheets
mark with an asterisk and which doubles the figure). CPU: there is no meaningful datasheet peak
for "whatever this host is", so it is this host's own GEMM throughput, measured once by a
short microbenchmark (square matmuls, best of several) and cached per (CPU model, torch thread
count, torch version, dtype) in $MEGARL_CACHE_DIR/cpu_peak.json (default ~/.cache/megarl). An MFU
on CPU is then the fraction of what torch's own matmul reaches on this host.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from megarl.config.devices import cuda_datasheet_entry

T = 1e12

# TFLOPS per GPU, dense. Sources (NVIDIA datasheets; sparse figures halved):
# - H100 SXM / H100 PCIe / H100 NVL: "NVIDIA H100 Tensor Core GPU" datasheet. SXM: FP32 67,
#   TF32 989*, BF16 1,979*, FP8 3,958*. PCIe: FP32 51, TF32 756*, BF16 1,513*, FP8 3,026*.
#   NVL: FP32 60, TF32 835*, BF16 1,671*, FP8 3,341*.
# - H200 SXM: "NVIDIA H200 Tensor Core GPU" datasheet: FP32 67, TF32 989*, BF16 1,979*,
#   FP8 3,958* (same GH100 compute as H100 SXM, more and faster memory). GH200 likewise.
# - B200: HGX B200 specifications, per GPU (1,000 W): FP32 75, TF32 2.2 PF*, BF16 4.5 PF*,
#   FP8 9 PF*. (The 1,200 W B200 inside GB200 is faster: 2.5 PF BF16 dense; not listed here.)
# - B300 (Blackwell Ultra): HGX B300 specifications, 8 GPUs: FP32 600, TF32 18 PF*, BF16 36 PF*,
#   FP8 72 PF*, i.e. per GPU the HGX B200 figures (its gains are dense FP4 and memory).
# - H20 (96 GB, the export Hopper part): "NVIDIA H20" product brief: FP32 44, TF32 74, BF16 148,
#   FP8 296 (dense); verl's flops_counter uses the same 148 for its MFU.
# - A100 (SXM4 and PCIe, 40 and 80 GB): "NVIDIA A100 Tensor Core GPU" datasheet: FP32 19.5,
#   TF32 312*, BF16 624*; no FP8 support.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp8": 1979.0},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp8": 1513.0},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp8": 1670.5},
    "H200": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp8": 1979.0},
    "B200": {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp8": 4500.0},
    "B300": {"fp32": 75.0, "tf32": 1125.0, "bf16": 2250.0, "fp8": 4500.0},
    "H20": {"fp32": 44.0, "tf32": 74.0, "bf16": 148.0, "fp8": 296.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0},
}

_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp16": "bf16",
    "float16": "bf16",
    "half": "bf16",
    "torch.float16": "bf16",  # same tensor-core rate
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "tf32": "tf32",
    "fp8": "fp8",
    "e4m3": "fp8",
    "float8_e4m3fn": "fp8",
}

# The CPU benchmark: square matmuls of these sizes, round after round, for at least CPU_MIN_ROUNDS
# rounds and until the time share has passed; the best single matmul counts (other processes on
# a shared machine only ever make a run slower). Run once with torch's current thread count and
# once single-threaded; the peak is the larger of the threaded best and threads x the
# single-threaded best. A threaded GEMM stalls whenever any of its threads is descheduled, so on a
# busy machine the threaded figure alone swung 70-206 GFLOP/s between runs, while one thread held
# 95-100 GFLOP/s (2-core EPYC; unloaded, 2 threads reach 2 x 100).
CPU_SIZES = (256, 512, 1024)
CPU_MIN_ROUNDS = 3
CPU_BUDGET_S = 1.0


def normalize_dtype(dtype) -> str:
    """'bf16' | 'fp32' | 'tf32' | 'fp8' from a name or a torch dtype."""
    key = str(dtype).lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {dtype!r} for the peak-FLOPs table; use one of bf16, fp32, tf32, fp8")
    return _DTYPE_ALIASES[key]


def gpu_table_entry(gpu_name: str) -> str:
    """The PEAK_TFLOPS key of a torch.cuda.get_device_name() string (config/devices.py's rules)."""
    entry = cuda_datasheet_entry(gpu_name)
    if entry is not None:
        return entry
    raise ValueError(
        f"no peak-FLOPs entry for GPU {gpu_name!r}; known: {', '.join(PEAK_TFLOPS)}. "
        "Add its datasheet numbers to megarl/perf/peak.py PEAK_TFLOPS"
    )


def gpu_peak_flops(gpu_name: str, dtype) -> float:
    """Dense datasheet FLOP/s of one GPU of this name in this dtype."""
    entry, dt = gpu_table_entry(gpu_name), normalize_dtype(dtype)
    if dt not in PEAK_TFLOPS[entry]:
        raise ValueError(
            f"{gpu_name!r} ({entry}) has no {dt} tensor cores; its table has {', '.join(PEAK_TFLOPS[entry])}"
        )
    return PEAK_TFLOPS[entry][dt] * T


def _gpu_name(index: int) -> str:
    import torch

    return torch.cuda.get_device_name(index)


def _cache_path(cache_dir: str | os.PathLike | None) -> Path:
    root = cache_dir or os.environ.get("MEGARL_CACHE_DIR") or Path.home() / ".cache" / "megarl"
    return Path(root) / "cpu_peak.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def cpu_cache_key(dtype: str = "fp32") -> str:
    """The cache key of this process: CPU model, torch thread count, torch version, dtype."""
    import torch

    return f"{_cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}|{dtype}"


def _best_gemm(mats, seconds: float) -> float:
    """Best FLOP/s of one (n, a, b, out) matmul over rounds lasting at least `seconds`."""
    import torch

    start, best, rounds = time.perf_counter(), 0.0, 0
    while rounds < CPU_MIN_ROUNDS or time.perf_counter() - start < seconds:
        for n, a, b, out in mats:
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            best = max(best, 2.0 * n**3 / (time.perf_counter() - t0))
        rounds += 1
    return best


def measure_cpu_gemm_flops(dtype: str = "fp32") -> dict:
    """This host's GEMM peak: {"flops", "threaded_flops", "single_thread_flops", "threads",
    "benchmark_s"} (see CPU_SIZES for the method)."""
    import torch

    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    mats = []
    for n in CPU_SIZES:
        a, b = (torch.randn(n, n, generator=gen).to(tdtype) for _ in range(2))
        out = torch.empty(n, n, dtype=tdtype)
        torch.mm(a, b, out=out)  # warm-up: first-call allocation and kernel selection
        mats.append((n, a, b, out))
    threads = torch.get_num_threads()
    threaded = _best_gemm(mats, CPU_BUDGET_S / 2)
    single = threaded
    if threads > 1:
        try:
            torch.set_num_threads(1)
            single = _best_gemm(mats, CPU_BUDGET_S / 2)
        finally:
            torch.set_num_threads(threads)
    return {
        "flops": max(threaded, threads * single),
        "threaded_flops": threaded,
        "single_thread_flops": single,
        "threads": threads,
        "benchmark_s": round(time.perf_counter() - start, 3),
    }


def cpu_peak_flops(dtype="fp32", cache_dir: str | os.PathLike | None = None) -> float:
    """This host's GEMM FLOP/s in fp32 (or bf16), measured on the first call and cached."""
    dt = normalize_dtype(dtype)
    if dt not in ("fp32", "bf16"):
        raise ValueError(f"CPU peak is measured for fp32 or bf16 matmuls, not {dt}")
    path, key = _cache_path(cache_dir), cpu_cache_key(dt)
    cache = _read_cache(path)
    if key in cache:
        return float(cache[key]["flops"])
    entry = measure_cpu_gemm_flops(dt)
    cache = _read_cache(path)  # another process may have written meanwhile: keep its entries
    cache[key] = {**entry, "sizes": list(CPU_SIZES), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return float(entry["flops"])


def cpu_peak_record(dtype="fp32", cache_dir: str | os.PathLike | None = None) -> dict:
    """How this host's cached CPU peak was measured (threaded / single-thread FLOP/s, threads,
    benchmark time, sizes, when); {} until cpu_peak_flops has measured it."""
    return _read_cache(_cache_path(cache_dir)).get(cpu_cache_key(normalize_dtype(dtype)), {})


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # absent or unreadable: measure again and rewrite it
        return {}
    return data if isinstance(data, dict) else {}


def device_peak_flops(device, dtype, cache_dir: str | os.PathLike | None = None) -> float:
    """Peak FLOP/s of one device: "cuda[:N]" from the datasheet table, "cpu" measured (cached)."""
    dev = str(device)
    if dev == "cpu":
        return cpu_peak_flops(dtype, cache_dir)
    if dev == "cuda" or dev.startswith("cuda:"):
        index = int(dev.split(":", 1)[1]) if ":" in dev else _current_cuda_index()
        return gpu_peak_flops(_gpu_name(index), dtype)
    raise ValueError(f"device {dev!r}: expected 'cpu', 'cuda' or 'cuda:N'")


def _current_cuda_index() -> int:
    import torch

    return torch.cuda.current_device()


def mfu(flops: float, seconds: float, devices: int, peak_per_device: float) -> float:
    """Model FLOPs utilisation: achieved FLOPs / (seconds x devices x peak FLOP/s per device)."""
    if seconds <= 0 or devices <= 0 or peak_per_device <= 0:
        raise ValueError(f"mfu needs positive seconds, devices and peak; got {seconds}, {devices}, {peak_per_device}")
    return flops / (seconds * devices * peak_per_device)
