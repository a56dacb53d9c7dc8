"""pipeline.plan.gpus: the cards table answers the names torch and nvidia-smi print."""

from __future__ import annotations

import pytest

from pipeline.plan.gpus import GPUS, lookup, peak_tflops_for_device


def test_gpu_lookup_accepts_device_names() -> None:
    assert lookup("NVIDIA GeForce RTX 4090 D").name == "RTX 4090D"
    assert lookup("NVIDIA GeForce RTX 4090").name == "RTX 4090"
    assert lookup("NVIDIA H200").name == "H200 SXM"
    with pytest.raises(KeyError):
        lookup("voodoo2")


@pytest.mark.parametrize(
    "torch_name, row, tflops",
    [
        ("NVIDIA A100-SXM4-40GB", "a100-40gb", 312.0),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb", 312.0),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb-pcie", 312.0),
        ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie", 312.0),
        ("NVIDIA L40S", "l40s", 362.0),
        ("NVIDIA H100 80GB HBM3", "h100", 989.0),
        ("NVIDIA H100 PCIe", "h100-pcie", 756.0),  # not the SXM peak
        ("NVIDIA H100 NVL", "h100-nvl", 835.0),
        ("NVIDIA H200", "h200", 989.0),
        ("NVIDIA H200 NVL", "h200-nvl", 835.0),
    ],
)
def test_names_torch_reports_map_to_their_own_row(torch_name: str, row: str, tflops: float) -> None:
    assert lookup(torch_name) is GPUS[row]
    assert peak_tflops_for_device(torch_name) == tflops
    assert peak_tflops_for_device("NVIDIA Voodoo2") is None  # MFU shows n/a, the run goes on
