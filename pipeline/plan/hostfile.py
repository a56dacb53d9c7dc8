"""DeepSpeed hostfiles (`HOST slots=N` lines) and this project's `# cluster: key=value ...` line in them, which
says what each node has (see hostfiles/). Read by the planner, the launcher and the doctor."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.plan.probe import parse_packages


def parse_hostfile(path: str) -> tuple[int, int]:
    """(nodes, GPUs per node) from a DeepSpeed hostfile (`host slots=N` lines, # comments)."""
    slots = hostfile_slots(path)
    if len(set(slots)) > 1:
        raise PipelineError(
            f"--hostfile {path}: hosts with different slot counts ({', '.join(map(str, slots))}); "
            "the planner assumes identical nodes: plan a hostfile of the smaller nodes"
        )
    return len(slots), slots[0]


def hostfile_slots(path: str) -> list[int]:
    """The slots of each host of a DeepSpeed hostfile, in order."""
    return [n for _, n in hostfile_hosts(path)]


def hostfile_hosts(path: str) -> list[tuple[str, int]]:
    """(host, slots) of each host of a DeepSpeed hostfile, in order."""
    p = Path(path)
    if not p.is_file():
        raise PipelineError(f"--hostfile {path}: {'is a folder' if p.is_dir() else 'no such file'} (see hostfiles/)")
    slots = []
    lines: dict[str, int] = {}
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^(\S+)\s+slots=(\d+)", line)
            if not m:
                raise PipelineError(f"{path}:{n}: expected 'HOST slots=N', got {line!r}")
            if int(m.group(2)) < 1:
                raise PipelineError(f"{path}:{n}: slots={m.group(2)}; a host needs 1 slot or more")
            if m.group(1) in lines:
                raise PipelineError(
                    f"{path}:{n}: host {m.group(1)} is listed again (first on line {lines[m.group(1)]}); give each "
                    "host once, with all its GPUs as its slots"
                )
            lines[m.group(1)] = n
            slots.append((m.group(1), int(m.group(2))))
    if not slots:
        raise PipelineError(f"{path}: no hosts")
    return slots


HOSTFILE_FACTS = ("gpu", "cpu_mem", "cpu_cores", "cpu_mem_bw", "disk", "network", "nvme", "packages", "probe")


def hostfile_facts(path: str) -> dict[str, str]:
    """The cluster facts of a hostfile's `# cluster: key=value ...` line (see hostfiles/): what each node has, for
    the planner and people. Empty when the hostfile has none."""
    facts: dict[str, str] = {}
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            m = re.match(r"^#\s*cluster:\s*(.*)$", line.strip())
            if not m:
                continue
            for item in m.group(1).split():
                key, sep, value = item.partition("=")
                if not sep or not value or key not in HOSTFILE_FACTS:
                    raise PipelineError(
                        f"{path}:{n}: '{item}' in the cluster line; expected key=value with keys "
                        f"{', '.join(HOSTFILE_FACTS)}"
                    )
                if key == "packages":
                    parse_packages(value, f"{path}:{n}: packages=")
                facts[key] = value
    return facts
