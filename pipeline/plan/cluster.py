"""What the planner plans for: a cluster (nodes, their GPU, RAM, cores, network, disk) and one candidate
configuration (ZeRO stage, offload, checkpointing, batch, buckets). Plain data, shared by memory and search."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.plan.gpus import GPU


@dataclass(frozen=True, slots=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu: GPU
    cpu_mem_bytes: int
    nvme_bytes: int = 0
    network_gbps: float = 100.0
    nvme_gbs: float = 3.0  # per node, sequential read/write
    cpu_mem_bw_gbs: float = 80.0  # effective host memory bandwidth per node (CPU Adam; PCIe DMA shares it)
    cpu_cores: int = 32  # per node: DeepSpeed's CPU Adam runs on them
    disk_bytes: int = 0  # free space for checkpoints per node (0: not counted)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, slots=True)
class Candidate:
    stage: int
    offload_optimizer: str  # none | cpu | nvme
    offload_param: str  # none | cpu | nvme
    activation_checkpointing: bool
    micro_batch_size: int
    grad_accum: int
    reduce_bucket: float = 5e8
    prefetch_bucket: float = 5e7
    max_live: float = 1e9
    sub_group: float = 1e9
    max_reuse: float | None = None  # stage3_max_reuse_distance; None: equal to max_live (what ds_config writes)

    def label(self) -> str:
        off = "" if self.offload_optimizer == "none" else f" + {self.offload_optimizer} offload (opt"
        if off:
            off += ", params)" if self.offload_param != "none" else ")"
        ck = " + ckpt" if self.activation_checkpointing else ""
        return f"ZeRO-{self.stage}{off}{ck}, micro {self.micro_batch_size} x GA {self.grad_accum}"
