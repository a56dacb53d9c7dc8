"""DeepSpeed hostfiles (`HOST slots=N` lines) and this project's `# cluster: key=value ...` line in them, which
says what each node has (see hostfiles/); and Slurm's compressed host lists (`node[01-08]`), the other way nodes
are named. Read by the planner, the launcher and the doctor."""

from __future__ import annotations

import itertools
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


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded in order: `node[01-03,7],gpu-a[1-2]-x` -> node01 node02 node03 node7
    gpu-a1-x gpu-a2-x (zero padding kept; several bracket groups in one name give their product)."""
    names: list[str] = []
    for item in _split_top(text.strip()):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("["):
                choices.append(_range_values(part[1:-1], text))
            elif part:
                choices.append([part])
        names += ["".join(p) for p in itertools.product(*choices)]
    if not names:
        raise PipelineError(f"the node list {text!r} names no node")
    return names


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise PipelineError(f"the node list {text!r} has an unclosed '['")
    return [x for x in [*out, cur] if x]


def _range_values(spec: str, text: str) -> list[str]:
    values = []
    for piece in spec.split(","):
        lo, _, hi = piece.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise PipelineError(f"the node list {text!r}: [{spec}] is not a list of numbers and ranges")
        width = len(lo)
        values += [str(n).zfill(width) for n in range(int(lo), int(hi or lo) + 1)]
    return values
