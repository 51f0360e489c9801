"""What the planner knows about a device: memory, FLOP/s, memory bandwidth and its links.

`parse_devices("256xH100")` -> (256, Device). GPU figures are datasheet numbers (memory as
nvidia-smi reports the card's total, bandwidths per GPU and per direction); the planner applies
its stated efficiencies to them (megarl/perf/steptime.py), never assumes the datasheet is reached.
FLOP/s per dtype come from megarl/perf/peak.py's table (its comment names the datasheets): dense
FP8 is H100 SXM 1,979 TF, H20 296 TF, B200 and B300 4.5 PF, read only to price published FP8 runs
(megarl trains in bf16).

- H100 SXM: 81,559 MiB HBM3, 3.35 TB/s; NVLink 4 900 GB/s bidirectional (450 per direction);
  PCIe Gen5 x16 64 GB/s; one 400 Gb/s ConnectX-7 NIC per GPU in DGX/HGX nodes (50 GB/s).
- H200: 143,771 MiB HBM3e, 4.8 TB/s; links as H100 SXM.
- B200: 183,359 MiB HBM3e, 8 TB/s; NVLink 5 1.8 TB/s bidirectional; PCIe Gen5; 400 Gb/s per GPU.
- B300 (HGX): 288 GB HBM3e, of which the runtime reports ~275 GiB (281,600 MiB, rounded: the
  exact figure is not in a datasheet), 8 TB/s; NVLink 5 as B200; PCIe Gen6 x16 (128 GB/s);
  one 800 Gb/s ConnectX-8 SuperNIC per GPU (100 GB/s).
- H20: 97,871 MiB HBM3, 4.0 TB/s; NVLink 900 GB/s bidirectional; PCIe Gen5; 400 Gb/s per GPU
  (the GPU of verl's published DeepSeek-V3 and Qwen3-30B-A3B runs).
- A100 80GB SXM: 81,920 MiB HBM2e, 2.04 TB/s; NVLink 3 600 GB/s bidirectional; PCIe Gen4 32 GB/s;
  200 Gb/s HDR per GPU (25 GB/s).
- CPU: a megarl "device" on a machine without CUDA is one rank's share of the host: memory is
  the host's RAM over the devices of the node, FLOP/s this host's measured GEMM throughput
  (megarl/perf/peak.py), "links" are shared memory (a memcpy's bandwidth, stated below).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from megarl.config.devices import DEVICE_TYPES, canonical_device
from megarl.perf.peak import PEAK_TFLOPS

GiB = 1024**3
MiB = 1024**2
GB = 1e9


@dataclass(frozen=True)
class Device:
    name: str  # table entry (PEAK_TFLOPS key) or "CPU"
    memory: float  # bytes
    hbm_bw: float  # device memory bandwidth, bytes/s
    nvlink_bw: float  # inside a node, per direction, bytes/s
    net_bw: float  # between nodes, per device, bytes/s
    pcie_bw: float  # host <-> device (offload), bytes/s
    runtime_reserve: float  # per process: CUDA context, NCCL and cuBLAS workspaces, allocator slack
    peak: dict  # dtype -> FLOP/s (dense)

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak:
            raise ValueError(f"{self.name} has no {dtype} peak; known: {', '.join(self.peak)}")
        return self.peak[dtype]


def _gpu(key: str, memory_mib: float, hbm_tb_s: float, nvlink_gb_s: float, net_gb_s: float, pcie_gb_s: float) -> Device:
    # runtime reserve per GPU process: ~0.5 GiB CUDA context, ~1 GiB NCCL buffers (more channels on
    # bigger jobs), cuBLAS workspaces, and caching-allocator fragmentation, which Megatron users
    # budget at a few GiB; 4 GiB is the planner's stated figure (its calibration is in RESULTS.md)
    name = DEVICE_TYPES[key]  # cluster.device_type's name -> the datasheet entry
    return Device(
        name,
        memory_mib * MiB,
        hbm_tb_s * 1e12,
        nvlink_gb_s * GB,
        net_gb_s * GB,
        pcie_gb_s * GB,
        4 * GiB,
        {k: v * 1e12 for k, v in PEAK_TFLOPS[name].items()},
    )


# keyed by config/devices.py's names, which cluster.device_type accepts
GPUS: dict[str, Device] = {
    "H100": _gpu("H100", 81559, 3.35, 450, 50, 64),
    "H100 PCIe": _gpu("H100 PCIe", 81559, 2.0, 300, 50, 64),
    "H200": _gpu("H200", 143771, 4.8, 450, 50, 64),
    "B200": _gpu("B200", 183359, 8.0, 900, 50, 64),
    "B300": _gpu("B300", 281600, 8.0, 900, 100, 128),
    "H20": _gpu("H20", 97871, 4.0, 450, 50, 64),
    "A100": _gpu("A100", 81920, 2.04, 300, 25, 32),
}

# CPU: a memcpy between processes' shared memory moves ~5 GB/s per core on the 2-core machine
# this project is built on (benchmarks/bench_bridge.py's raw transport peer measures it)
CPU_COPY_BW = 5 * GB


def cpu_device(devices_on_node: int, host_memory: float | None = None, peak: float | None = None) -> Device:
    """One rank's share of this host (memory of the whole host over `devices_on_node`)."""
    if host_memory is None:
        host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if peak is None:
        from megarl.perf.peak import cpu_peak_flops

        peak = cpu_peak_flops("fp32")
    # per process: Python + torch + Megatron imports, ~0.6 GiB resident (a quickstart rank: 590-626 MiB
    # peak RSS, benchmarks/bench_plan.py --cpu)
    return Device(
        "CPU",
        host_memory / max(devices_on_node, 1),
        CPU_COPY_BW,
        CPU_COPY_BW,
        CPU_COPY_BW,
        CPU_COPY_BW,
        0.6 * GiB,
        {"fp32": peak, "bf16": peak},
    )


def parse_devices(spec: str, devices_on_node: int | None = None) -> tuple[int, Device]:
    """'256xH100' -> (256, H100). 'CPU' alone or '2xCPU' -> this host's share per device."""
    m = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?([A-Za-z0-9 _-]+?)\s*", spec or "")
    if not m:
        raise ValueError(f"--devices {spec!r}: expected COUNTxTYPE, e.g. 256xH100 or 8xH200")
    count = int(m.group(1)) if m.group(1) else None
    kind = m.group(2)
    if kind.lower() == "cpu":
        n = count or 1
        return n, cpu_device(devices_on_node or n)
    key = canonical_device(kind)
    if key is None:
        raise ValueError(f"--devices {spec!r}: unknown device {kind!r}; known: {', '.join(list(GPUS) + ['CPU'])}")
    if count is None:
        raise ValueError(f"--devices {spec!r}: say how many, e.g. 256x{key}")
    return count, GPUS[key]


def with_memory(device: Device, memory_gib: float) -> Device:
    return replace(device, memory=memory_gib * GiB)
