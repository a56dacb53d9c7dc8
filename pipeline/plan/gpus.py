"""GPU table for the planner and for MFU in training logs. Figures from vendor datasheets and measurements;
sources in ../shared/research/hardware-and-limits.md [S#] and beside each row.

bf16_tflops is the dense bf16 tensor rate with fp32 accumulate, the rate PyTorch training uses. GeForce cards run
fp32-accumulate at half the fp16-accumulate rate (updated Ada whitepaper [S4]), so a 4090 is 165 TF, not 330.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GPU:
    name: str
    memory_gib: float          # usable device memory as the driver reports it, GiB
    bf16_tflops: float         # dense bf16, fp32 accumulate
    mem_bw_gbs: float          # device memory bandwidth, GB/s
    pcie_gen: int              # host link generation (x16)
    pcie_gbs: float            # measured host<->device copy rate per direction, GB/s
    p2p: bool                  # peer-to-peer between cards in one node with the stock driver
    nvlink_gbs: float = 0.0


GPUS: dict[str, GPU] = {
    # GA102 whitepaper: 142 TF dense fp16 with fp16 accumulate, half (71 TF) with fp32 accumulate on GeForce.
    "3090": GPU("RTX 3090", 23.7, 71.0, 936, 4, 25.0, False),
    "4090": GPU("RTX 4090", 23.6, 165.2, 1008, 4, 25.0, False),          # [S3,S4]
    "4090d": GPU("RTX 4090D", 23.6, 147.1, 1008, 4, 25.0, False),        # [S1]
    "a100-40gb": GPU("A100 40GB", 39.4, 312.0, 1555, 4, 25.0, True, 600.0),   # [S10]
    "a100-80gb": GPU("A100 80GB", 79.2, 312.0, 2039, 4, 25.0, True, 600.0),   # [S10]
    "h100": GPU("H100 SXM", 79.2, 989.0, 3350, 5, 55.0, True, 900.0),    # [S12,S13]
    "h200": GPU("H200 SXM", 139.8, 989.0, 4800, 5, 55.0, True, 900.0),   # [S12,S13]; 55 GB/s copy measured
}


def lookup(name: str) -> GPU:
    key = name.lower().replace("rtx", "").replace(" ", "").replace("-", "").replace("nvidia", "").replace("geforce", "")
    for k, g in GPUS.items():
        if key == k.replace("-", ""):
            return g
    aliases = {"a100": "a100-80gb", "a10080g": "a100-80gb", "a10040g": "a100-40gb", "h100sxm": "h100",
               "h100sxm5": "h100", "h200sxm": "h200", "h100sxm580gb": "h100", "4090d24gb": "4090d"}
    if key in aliases:
        return GPUS[aliases[key]]
    for k, g in GPUS.items():  # a device name as torch reports it, e.g. "NVIDIA GeForce RTX 4090 D"
        if k.replace("-", "") in key and (k != "4090" or "4090d" not in key):
            return g
    raise KeyError(f"unknown GPU '{name}'; known: {', '.join(GPUS)}")


def peak_tflops_for_device(device_name: str) -> float | None:
    try:
        return lookup(device_name).bf16_tflops
    except KeyError:
        return None
