"""GPU table for the planner and for MFU in training logs. Figures from vendor datasheets and measurements;
sources in ../shared/research/hardware-and-limits.md [S#] and beside each row.

bf16_tflops is the dense bf16 tensor rate with fp32 accumulate, the rate PyTorch training uses. GeForce cards run
fp32-accumulate at half the fp16-accumulate rate (updated Ada whitepaper [S4]), so a 4090 is 165 TF, not 330.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class GPU:
    name: str
    memory_gib: float  # usable device memory as the driver reports it, GiB
    bf16_tflops: float  # dense bf16, fp32 accumulate
    mem_bw_gbs: float  # device memory bandwidth, GB/s
    pcie_gen: int  # host link generation (x16)
    pcie_gbs: float  # measured host<->device copy rate per direction, GB/s
    p2p: bool  # peer-to-peer between cards in one node with the stock driver
    nvlink_gbs: float = 0.0
    gemm_fraction: float = 0.85
    """The share of bf16_tflops a large bf16 GEMM reaches (cuBLAS, 8192^3): the ceiling of training's efficiency."""
    gpudirect: bool = False
    """GPUDirect RDMA: NCCL moves inter-node traffic NIC <-> GPU without staging it in host memory."""
    fp8: bool = False
    """FP8 tensor cores at twice the bf16 rate with fp32 accumulation (Ada sm_89, Hopper sm_90): train.fp8 pays."""


GPUS: dict[str, GPU] = {
    # GA102 whitepaper: 142 TF dense fp16 with fp16 accumulate, half (71 TF) with fp32 accumulate on GeForce.
    "3090": GPU("RTX 3090", 23.7, 71.0, 936, 4, 25.0, False, gemm_fraction=0.95),
    # GeForce Ada: a measured 4090 bf16 GEMM reaches 151-165 of 165 TF [S5]; no GPUDirect RDMA [S15].
    "4090": GPU("RTX 4090", 23.6, 165.2, 1008, 4, 25.0, False, gemm_fraction=0.95, fp8=True),  # [S3,S4]
    "4090d": GPU("RTX 4090D", 23.6, 147.1, 1008, 4, 25.0, False, gemm_fraction=0.95, fp8=True),  # [S1]
    # Ada data-center card: NVIDIA L40S datasheet, BF16 362.05 TF dense (733 with sparsity), 48 GB GDDR6, 864 GB/s.
    "l40s": GPU("L40S", 44.4, 362.0, 864, 4, 25.0, True, gemm_fraction=0.8, gpudirect=True, fp8=True),
    # V100 has no bf16: its fp16 tensor rate (125 TF, V100 SXM2 datasheet) is what mixed precision runs at.
    "v100": GPU("V100 SXM2 32GB", 31.7, 125.0, 900, 3, 12.0, True, 300.0, gemm_fraction=0.85, gpudirect=True),
    "a100-40gb": GPU("A100 SXM4 40GB", 39.4, 312.0, 1555, 4, 25.0, True, 600.0, gemm_fraction=0.85, gpudirect=True),
    "a100-80gb": GPU("A100 SXM4 80GB", 79.2, 312.0, 2039, 4, 25.0, True, 600.0, gemm_fraction=0.85, gpudirect=True),
    # PCIe A100s: same tensor peak (A100 datasheet), lower memory bandwidth, no NVSwitch.
    "a100-40gb-pcie": GPU("A100 PCIe 40GB", 39.4, 312.0, 1555, 4, 25.0, True, gemm_fraction=0.85, gpudirect=True),
    "a100-80gb-pcie": GPU("A100 PCIe 80GB", 79.2, 312.0, 1935, 4, 25.0, True, gemm_fraction=0.85, gpudirect=True),
    "h100": GPU("H100 SXM", 79.2, 989.0, 3350, 5, 55.0, True, 900.0, gemm_fraction=0.8, gpudirect=True, fp8=True),
    # NVIDIA H100 datasheet: the PCIe card is 1,513 TF BF16 with sparsity (756 dense), 2.0 TB/s; the NVL card
    # 1,671 TF with sparsity (835 dense), 94 GB, 3.9 TB/s, NVLink bridge 600 GB/s.
    "h100-pcie": GPU("H100 PCIe", 79.2, 756.0, 2000, 5, 55.0, True, gemm_fraction=0.8, gpudirect=True, fp8=True),
    "h100-nvl": GPU("H100 NVL", 87.5, 835.0, 3900, 5, 55.0, True, 600.0, gemm_fraction=0.8, gpudirect=True, fp8=True),
    # [S12,S13]; measured on the lent H200: 55 GB/s pinned copies, an 8192^3 bf16 matmul at 799 TF (0.81).
    "h200": GPU("H200 SXM", 139.8, 989.0, 4800, 5, 55.0, True, 900.0, gemm_fraction=0.81, gpudirect=True, fp8=True),
    # NVIDIA H200 datasheet: the NVL card is 1,671 TF BF16 with sparsity (835 dense), 141 GB, 4.8 TB/s.
    "h200-nvl": GPU("H200 NVL", 139.8, 835.0, 4800, 5, 55.0, True, 900.0, gemm_fraction=0.81, gpudirect=True, fp8=True),
}


def _key(name: str) -> str:
    """A GPU name as torch, nvidia-smi or a person writes it -> one key: 'NVIDIA A100-PCIE-40GB' -> a10040gbpcie,
    'NVIDIA A100-SXM4-80GB' -> a10080gb, 'NVIDIA H100 80GB HBM3' -> h10080gb, 'NVIDIA GeForce RTX 4090 D' -> 4090d."""
    key = name.lower()
    for word in (
        "nvidia",
        "geforce",
        "tesla",
        "rtx",
        "sxm5",
        "sxm4",
        "sxm3",
        "sxm2",
        "sxm",
        "hbm3e",
        "hbm3",
        " ",
        "-",
        "_",
    ):
        key = key.replace(word, "")
    return key.replace("pcie", "") + "pcie" if "pcie" in key else key


_BY_KEY = sorted(((_key(k), k) for k in GPUS), key=lambda kv: -len(kv[0]))  # longest first: h200nvl before h200


def lookup(name: str) -> GPU:
    key = _key(name)
    aliases = {"a100": "a100-80gb", "a10080g": "a100-80gb", "a10040g": "a100-40gb"}
    if key in aliases:
        return GPUS[aliases[key]]
    for k, table_key in _BY_KEY:
        if key == k:
            return GPUS[table_key]
    for k, table_key in _BY_KEY:  # a device name with its memory size, e.g. "NVIDIA H100 80GB HBM3"
        if key.startswith(k) and ("pcie" in key) == ("pcie" in k) and re.fullmatch(r"(\d+gb)?", _rest(key, k)):
            return GPUS[table_key]
    near = [t for k, t in _BY_KEY if key.startswith(k)]
    hint = (
        f" ('{name}' is not the {GPUS[near[0]].name}; plan with the closest known card, knowing that its peak and "
        "memory are not yours)"
        if near
        else ""
    )
    raise KeyError(f"unknown GPU '{name}'{hint}; known: {', '.join(GPUS)}")


def _rest(key: str, table_key: str) -> str:
    return key.removeprefix(table_key).removesuffix("pcie") if "pcie" in table_key else key.removeprefix(table_key)


def peak_tflops_for_device(device_name: str) -> float | None:
    try:
        return lookup(device_name).bf16_tflops
    except KeyError:
        return None


def capped(card: GPU, cap_gib: float | None) -> GPU:
    """The card with the memory a run may use: its own, or less under a cap (`train.gpu_memory_cap_gib`, `--gpu-mem`:
    a 24 GiB 4090D emulated on a larger GPU is planned as 24 GiB)."""
    return replace(card, memory_gib=min(card.memory_gib, cap_gib)) if cap_gib else card
