"""Where a plan's cluster comes from: the `pipeline plan` flags, else the hostfile's `# cluster:` line, else the seed
cluster's node (CLUSTER_DEFAULTS), then what `pipeline probe` measured on a node; each fact checked, and a line
saying which came from where."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.plan.cluster import Cluster
from pipeline.plan.gpus import lookup
from pipeline.plan.hostfile import hostfile_facts, parse_hostfile
from pipeline.plan.probe import SUFFIX, measured, parse_packages
from pipeline.units import parse_gbps, parse_size

CLUSTER_DEFAULTS: dict[str, str | None] = {
    "gpu": "4090d",
    "gpu_mem": None,
    "cpu_mem": "512GB",
    "cpu_cores": "32",
    "cpu_mem_bw": "80GB/s",
    "disk": None,
    "nvme": None,
    "network": "100Gbps",
    "packages": None,
    "probe": None,
}
"""Each node's facts when neither a flag nor the hostfile's `# cluster:` line gives them (the seed cluster's node)."""
NODE_FACTS: dict[str, str] = {
    "gpu": "3090, 4090, 4090d, l40s, v100, a100-40gb, a100-80gb, a100-40gb-pcie, a100-80gb-pcie, h100, h100-pcie, "
    "h100-nvl, h200, h200-nvl, or a name as nvidia-smi prints it.",
    "gpu_mem": "Cap the card's memory, e.g. 24GiB (emulating a smaller card).",
    "cpu_mem": "Host RAM per node.",
    "cpu_cores": "CPU cores per node (DeepSpeed's CPU Adam under offload).",
    "cpu_mem_bw": "Host memory bandwidth per node (CPU Adam and the cards' copies share it).",
    "disk": "Free disk per node at the run folder, for checkpoints (e.g. 40GB, or the folder itself).",
    "nvme": "NVMe capacity per node for ZeRO-Infinity, e.g. 4TB (or a mounted path).",
    "network": "Inter-node bandwidth per node.",
    "packages": "Kernel packages installed on the nodes, comma-separated, or none: liger-kernel (pip install -e "
    "'.[gpu]': Liger's modules, fewer activations kept), flash-attn ('.[flash]': whole documents without a mask) "
    "[default: what `pipeline probe` found on a node, else none: transformers' modules and SDPA are priced].",
    "probe": "A node's rates measured by `pipeline probe` [default: HOSTFILE.probe.json when there is one, or the "
    "hostfile's probe=FILE].",
}
"""What each of CLUSTER_DEFAULTS' facts is: `pipeline plan`'s option of the same name (--cpu-mem-bw) says it."""


def cluster_from_flags(
    hostfile: str | None, nodes: int, gpus_per_node: int, flags: dict[str, str | None]
) -> tuple[Cluster, str]:
    """The cluster the planner plans for: nodes and GPUs per node from a hostfile when given, each node's facts from
    the flags given (`flags`, keys of CLUSTER_DEFAULTS; None: not given), else the hostfile's `# cluster:` line, else
    CLUSTER_DEFAULTS, then what `pipeline probe` measured on a node (`probe_path`); and lines saying which was
    which."""
    given = {k for k, v in flags.items() if v is not None}
    if hostfile:
        nodes, gpus_per_node = parse_hostfile(hostfile)
    values, source = node_facts(hostfile, flags, given)
    cluster = _cluster(nodes, gpus_per_node, values)
    if probe := probe_path(hostfile, flags, values):
        if hostfile and (stranger := probe_host_outside(probe, hostfile)):
            if not flags.get("probe"):  # found beside the hostfile, not asked for: not this cluster's figures
                note = (
                    f"not used: {probe} was measured on {stranger}, which is not a host of {hostfile}; run "
                    "`pipeline probe --hostfile` on one of its nodes (or give --probe FILE to use it anyway)"
                )
                return cluster, f"{source}\n{note}" if source else note
            given_note = f" ({stranger} is not a host of {hostfile}: used because --probe names it)"
        else:
            given_note = ""
        cluster, note = with_probe(cluster, probe, given)
        note += given_note
        source = f"{source}\n{note}" if source else note
    return cluster, source


def probe_host_outside(probe: Path, hostfile: str) -> str | None:
    """The host a probe was measured on when it is none of the hostfile's (by short name; localhost is this
    machine), else None. A probe that does not say its host is taken as the cluster's."""
    import json
    import socket

    from pipeline.plan.hostfile import hostfile_hosts

    try:
        host = json.loads(probe.read_text()).get("host")
    except (OSError, ValueError, AttributeError):
        return None  # `measured` says what is wrong with the file
    if not isinstance(host, str):
        return None
    short = {h.split(".")[0].lower() for h, _ in hostfile_hosts(hostfile)}
    if short & {"localhost", "127"}:
        short.add(socket.gethostname().split(".")[0].lower())
    return None if host.split(".")[0].lower() in short else host


def probe_in_use(hostfile: str | None, flags: dict[str, str | None]) -> Path | None:
    """The probe file a plan with these options reads (`cluster_from_flags`), if any."""
    given = {k for k, v in flags.items() if v is not None}
    return probe_path(hostfile, flags, node_facts(hostfile, flags, given)[0])


def node_facts(
    hostfile: str | None, flags: dict[str, str | None], given: set[str]
) -> tuple[dict[str, str | None], str]:
    """Each node's facts as text (flags, else the hostfile's `# cluster:` line, else CLUSTER_DEFAULTS), and a line
    saying which came from where."""
    values = {**CLUSTER_DEFAULTS, **{k: flags[k] for k in given}}
    if hostfile:
        facts = hostfile_facts(hostfile)
        used = {k: v for k, v in facts.items() if k not in given}
        defaults = sorted(
            k
            for k in ("gpu", "cpu_mem", "cpu_cores", "cpu_mem_bw", "disk", "network")
            if k not in facts and k not in given
        )
        return {**values, **used}, (
            f"cluster facts from {hostfile}: "
            + (" ".join(f"{k}={v}" for k, v in used.items()) or "none")
            + (f"; defaults for {', '.join(defaults)}" if defaults else "")
            + ("" if facts else " (the hostfile has no '# cluster:' line; see hostfiles/8node)")
        )
    assumed = [k for k in ("gpu", "cpu_mem", "cpu_cores", "cpu_mem_bw", "network") if k not in given]
    if not assumed:
        return values, ""
    return values, (
        "assumed, not given: "
        + " ".join(f"{k}={CLUSTER_DEFAULTS[k]}" for k in assumed)
        + " (the seed cluster's node; give a --hostfile with a '# cluster:' line, or the flags)"
    )


def _size(values: dict[str, str | None], flag: str, allow_dir: bool = False) -> int:
    """A size fact in bytes (0 when not given); a folder: its free space."""
    text = values.get(flag)
    if not text:
        return 0
    if allow_dir and os.path.isdir(text):
        return shutil.disk_usage(text).free
    try:
        n = parse_size(text.replace("/s", "").replace("/S", ""))
    except ValueError as e:
        raise PipelineError(f"--{flag.replace('_', '-')}: {e}") from None
    if not n > 0:
        raise PipelineError(f"--{flag.replace('_', '-')} {text}: expected a positive size")
    return n


def _cluster(nodes: int, gpus_per_node: int, values: dict[str, str | None]) -> Cluster:
    """The Cluster of the facts' text, each checked."""
    try:
        card = lookup(str(values["gpu"]))
    except KeyError as e:
        raise PipelineError(str(e.args[0])) from None
    if values.get("gpu_mem"):
        card = replace(card, memory_gib=_size(values, "gpu_mem") / 2**30)
    network = str(values.get("network") or "")
    try:
        net = parse_gbps(network)
        cores = int(str(values["cpu_cores"]))
    except ValueError:
        raise PipelineError(
            f"--network {network} / --cpu-cores {values['cpu_cores']}: expected numbers such as 100Gbps and 32"
        ) from None
    if cores < 1:
        raise PipelineError(f"cpu_cores {cores}: expected 1 or more")
    cluster = Cluster(
        nodes,
        gpus_per_node,
        card,
        _size(values, "cpu_mem"),
        _size(values, "nvme", allow_dir=True),
        net,
        cpu_mem_bw_gbs=_size(values, "cpu_mem_bw") / 1e9,
        cpu_cores=cores,
        disk_bytes=_size(values, "disk", allow_dir=True),
        packages=parse_packages(str(values["packages"])) if values.get("packages") is not None else None,
    )
    if not cluster.cpu_mem_bytes or not cluster.cpu_mem_bw_gbs:
        raise PipelineError("--cpu-mem and --cpu-mem-bw must be positive sizes")
    return cluster


def probe_path(hostfile: str | None, flags: dict[str, str | None], values: dict[str, str | None]) -> Path | None:
    """The probe to plan with: --probe, else the hostfile's probe=FILE (beside it), else HOSTFILE.probe.json when
    there is one."""
    if flags.get("probe"):
        return Path(str(flags["probe"]))
    if not hostfile:
        return None
    if values.get("probe"):
        return Path(hostfile).parent / str(values["probe"])
    beside = Path(hostfile + SUFFIX)
    return beside if beside.exists() else None


def with_probe(c: Cluster, path: Path, given: set[str]) -> tuple[Cluster, str]:
    """The cluster with what `pipeline probe` measured on one of its nodes in place of the facts it measures (a
    flag given on the command line still wins), and a line saying so. The GPU's rates only for the same card."""
    m = measured(path)
    used = {"cpu_adam": f"CPU Adam {m['cpu_adam_params_per_s'] / 1e9:.3g}e9 fp32 parameters/s"}
    bw = c.cpu_mem_bw_gbs
    if "cpu_mem_bw" not in given:
        bw, used["cpu_mem_bw"] = m["cpu_mem_bw_gbs"], f"cpu_mem_bw={m['cpu_mem_bw_gbs']:.3g}GB/s"
    card, note = c.gpu, ""
    try:
        same = m["gpu"] is not None and lookup(m["gpu"]).name == c.gpu.name
    except KeyError:
        same = False
    if same and m.get("pcie_gbs"):
        card, used["pcie"] = replace(card, pcie_gbs=m["pcie_gbs"]), f"pinned copies {m['pcie_gbs']:.3g} GB/s"
    if same and m.get("gemm_tflops"):
        fraction = min(1.0, m["gemm_tflops"] / card.bf16_tflops)
        card, used["gemm"] = replace(card, gemm_fraction=fraction), f"GEMM ceiling {fraction:.0%} of peak"
    if m["gpu"] and not same:
        note = f"; its GPU ({m['gpu']}) is not this plan's {c.gpu.name}: the GPU's rates stay the table's"
    packages = c.packages
    if "packages" not in given and m.get("packages") is not None:
        packages = m["packages"]
        used["packages"] = f"packages={','.join(sorted(packages)) or 'none'}"
    c = replace(
        c,
        gpu=card,
        cpu_mem_bw_gbs=bw,
        cpu_adam_params_per_s=m["cpu_adam_params_per_s"],
        measured=frozenset(used) - {"packages"},
        packages=packages,
    )
    return c, f"measured by {m['source']}: {', '.join(used.values())}{note}"
