"""The accelerators a run's configuration may name (cluster.device_type), by name only.

The names live here, below the planner, so validation can refuse an unknown device before any
process starts without importing what the planner knows about it: megarl/perf/hardware.py holds
each device's memory and bandwidths, megarl/perf/peak.py its FLOP/s (both keyed by these names).

    canonical_device("h100") == canonical_device("NVIDIA H100 80GB HBM3") == "H100"
"""

from __future__ import annotations

# cluster.device_type's canonical names -> the datasheet entry (perf/peak.py PEAK_TFLOPS key)
DEVICE_TYPES: dict[str, str] = {
    "H100": "H100 SXM",
    "H100 PCIe": "H100 PCIe",
    "H200": "H200",
    "B200": "B200",
    "B300": "B300",
    "H20": "H20",
    "A100": "A100",
}
_ALIASES = {
    "h100": "H100",
    "h100-sxm": "H100",
    "h100sxm": "H100",
    "h100-pcie": "H100 PCIe",
    "h100pcie": "H100 PCIe",
    "h200": "H200",
    "b200": "B200",
    "b300": "B300",
    "h20": "H20",
    "a100": "A100",
    "a100-80gb": "A100",
}

# torch.cuda.get_device_name -> datasheet entry; first match wins, so the specific names come first.
# Real names: "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200",
# "NVIDIA GH200 480GB", "NVIDIA B200", "NVIDIA B300 SXM6 AC", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe".
CUDA_NAME_RULES: list[tuple[tuple[str, ...], str]] = [
    (("H100", "PCIE"), "H100 PCIe"),
    (("H100", "NVL"), "H100 NVL"),
    (("H100",), "H100 SXM"),
    (("H200",), "H200"),  # also GH200: the same Hopper compute
    (("H20",), "H20"),
    (("B200",), "B200"),
    (("B300",), "B300"),
    (("A100",), "A100"),
]


def known_device_types() -> list[str]:
    """The names cluster.device_type accepts, as an error message lists them."""
    return list(DEVICE_TYPES) + ["CPU"]


def cuda_datasheet_entry(gpu_name: str) -> str | None:
    """The datasheet entry of a torch.cuda.get_device_name() string, or None."""
    upper = gpu_name.upper()
    return next((entry for needles, entry in CUDA_NAME_RULES if all(n in upper for n in needles)), None)


def canonical_device(kind: str) -> str | None:
    """'h100' / 'H100' / 'NVIDIA H100 80GB HBM3' -> 'H100'; 'cpu' -> 'CPU'; None if unknown."""
    k = kind.strip()
    if k.lower() == "cpu":
        return "CPU"
    if k in DEVICE_TYPES:
        return k
    alias = _ALIASES.get(k.lower().replace(" ", "-"))
    if alias:
        return alias
    entry = cuda_datasheet_entry(k)  # a CUDA device name
    return next((key for key, name in DEVICE_TYPES.items() if name == entry), None)
