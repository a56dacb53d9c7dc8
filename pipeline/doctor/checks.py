"""The checks `pipeline doctor` makes on one host, each a PASS / WARN / FAIL with a one-line reason and the fix.
Run here for this machine, and on every host of a hostfile as `python -m pipeline.doctor.checks --json ...` (what
`pipeline doctor --hostfile` starts there over ssh); the cross-host comparisons are in pipeline.doctor.cluster.
Standard library only at import time: a host whose torch or deepspeed is broken still reports.

One job: the checks of one host. It is one file because it is what ssh runs on each host as a script
(`python -m pipeline.doctor.checks`): splitting it would make every host import a package tree to check itself."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
GIB = 2**30


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class Needs:
    """What the run needs of each host, from the planner on the config (None: not known)."""

    host_ram_bytes: float | None = None
    disk_bytes: float | None = None
    """Room for two checkpoints on the busiest node (the first), checked on every host."""
    run_dir: str | None = None
    nvme_path: str | None = None
    nvme_bytes: float | None = None
    data_path: str | None = None
    uses_nvme: bool = False
    cpu_adam: bool = False
    """The optimizer is offloaded to the CPU: `pipeline pretrain` binds each rank to its cores with numactl."""
    master_port: int | None = None
    pins_memory: bool = True
    """The run pins host memory (GPU runs: offload buffers, NCCL); CPU runs do not, and need no memlock limit."""
    peer: str | None = None
    """An address of another host: the interface that routes there is the one collectives will use."""
    shared_probe: str | None = None
    """A file the launching machine wrote into run_dir (or the folder it will be made in): every host must see it,
    since every rank writes its checkpoint shards there and resuming needs them all in one place."""
    launcher_host: str | None = None


@dataclass
class Report:
    host: str
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, status: str, detail: str, fix: str = "") -> None:
        self.checks.append(Check(name, status, detail, fix))

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "checks": [asdict(c) for c in self.checks], "facts": self.facts}


def python_and_versions(r: Report) -> None:

    versions: dict[str, str | None] = {}
    for pkg in ("torch", "deepspeed", "transformers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    r.facts.update(python=sys.executable, python_version=sys.version.split()[0], venv=sys.prefix, versions=versions)
    missing = [k for k, v in versions.items() if v is None]
    if missing:
        r.add("versions", FAIL, f"{', '.join(missing)} not installed in {sys.prefix}", "run `make install` here")
    else:
        r.add(
            "versions",
            PASS,
            f"python {r.facts['python_version']} ({sys.prefix}); " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        )


def deepspeed_ops(r: Report, needs: Needs, gpu: bool) -> None:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder, FusedAdamBuilder
    except Exception as e:  # a broken install raises anything
        r.add("deepspeed ops", FAIL, f"deepspeed does not import: {type(e).__name__}: {e}", "reinstall deepspeed")
        return
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        installed_ops = {}
    prebuilt = sorted(k for k, v in installed_ops.items() if v and k in ("cpu_adam", "fused_adam", "async_io"))
    problems, notes = (
        [],
        [
            f"prebuilt: {', '.join(prebuilt)}"
            if prebuilt
            else "none prebuilt: each is JIT-built on first use (about a minute, cached per machine)"
        ],
    )
    if not CPUAdamBuilder().is_compatible(verbose=False):
        problems.append("cpu_adam cannot build (offload needs it)")
    if gpu and not FusedAdamBuilder().is_compatible(verbose=False):
        problems.append("fused_adam cannot build")
    aio = AsyncIOBuilder().is_compatible(verbose=False)
    notes.append(f"async_io {'buildable' if aio else 'not buildable (libaio-dev missing)'}")
    if needs.uses_nvme and not aio:
        problems.append("the config offloads to NVMe, which needs async_io")
    if problems:
        r.add("deepspeed ops", FAIL, "; ".join(problems), "install a compiler and libaio-dev, then check `ds_report`")
    else:
        r.add(
            "deepspeed ops",
            PASS,
            "cpu_adam buildable" + (", fused_adam buildable" if gpu else "") + "; " + "; ".join(notes),
        )


def accelerator(r: Report) -> bool:
    try:
        import torch
    except Exception as e:
        r.add("accelerator", FAIL, f"torch does not import: {e}", "reinstall torch")
        return False
    if not torch.cuda.is_available():
        from pipeline.train.runtime.dist import unusable_gpu

        r.facts["gpus"] = []
        if problem := unusable_gpu():  # a GPU torch cannot use: `pipeline pretrain` refuses to train on the CPU
            r.add(
                "accelerator", FAIL, problem.split(". Install")[0], "install a CUDA build of torch the driver supports"
            )
        else:
            r.add("accelerator", WARN, "no GPU here: ranks would run on the CPU", "fine for tests; train on GPUs")
        return False
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    free = [torch.cuda.mem_get_info(i)[0] for i in range(len(gpus))]  # a card another job holds shows little free
    r.facts["gpus"] = [
        {"name": g.name, "memory_bytes": g.total_memory, "free_bytes": f} for g, f in zip(gpus, free, strict=True)
    ]
    names = ", ".join(f"{g.name} {g.total_memory / GIB:.1f} GiB" for g in gpus)
    r.add("accelerator", PASS, f"{len(gpus)} GPU(s): {names}; CUDA {torch.version.cuda}")
    if len(gpus) > 1:
        peer = all(torch.cuda.can_device_access_peer(0, j) for j in range(1, len(gpus)))
        geforce = any("GeForce" in g.name or "RTX 40" in g.name or "RTX 30" in g.name for g in gpus)
        r.facts["p2p"] = peer
        if not peer or geforce:
            r.facts["advise_p2p_disable"] = True
            r.add(
                "gpu p2p",
                WARN,
                (
                    "peer-to-peer access reported unavailable"
                    if not peer
                    else "consumer GeForce cards: NCCL's P2P path is known to hang (DeepSpeed #4433)"
                ),
                "NCCL_P2P_DISABLE=1 (pipeline doctor --write-env adds it)",
            )
        else:
            r.add("gpu p2p", PASS, "peer-to-peer access between the GPUs")
    return True


def network(r: Report, needs: Needs) -> None:
    addrs = _addresses()
    r.facts["addresses"] = addrs
    r.facts["infiniband"] = (
        bool(list(Path("/sys/class/infiniband").glob("*"))) if Path("/sys/class/infiniband").exists() else False
    )
    if needs.peer is None:
        r.add("network", PASS, f"addresses {' '.join(addrs) or 'none'} (no other host to route to)")
        return
    iface = _route_interface(needs.peer)
    if iface is None:
        r.add("network", FAIL, f"no route to {needs.peer}", "check the hosts' addresses and routes (ip route)")
        return
    speed = _link_speed_mbps(iface)
    r.facts.update(interface=iface, link_mbps=speed)
    r.add(
        "network",
        PASS,
        f"{iface} routes to {needs.peer}" + (f", link {speed / 1000:g} Gbps" if speed else ", link speed not reported"),
    )


def infiniband_devices(root: str = "/sys/class/infiniband") -> list[str]:
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


def shared_run_dir(r: Report, needs: Needs) -> None:
    """Whether this host sees the file the launching machine wrote into run_dir (`Needs.shared_probe`)."""
    if not needs.shared_probe:
        return
    if Path(needs.shared_probe).is_file():
        r.add("shared run_dir", PASS, f"{Path(needs.shared_probe).parent} is the folder {needs.launcher_host} wrote in")
        return
    r.add(
        "shared run_dir",
        FAIL,
        f"{needs.shared_probe}, written from {needs.launcher_host}, is not visible here: run_dir "
        f"{needs.run_dir} is this host's own folder. Every rank writes its checkpoint shards there; a resume, "
        "evaluation or export needs them all in one place",
        "put run_dir on storage every node mounts at the same path (NFS, a cluster file system)",
    )


def limits(r: Report, needs: Needs | None = None) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        r.add("ulimit -l", PASS, "locked memory unlimited")
    elif needs is not None and not needs.pins_memory:
        r.add("ulimit -l", PASS, f"locked memory limited to {soft / 2**20:.0f} MiB; this run pins none (CPU ranks)")
    elif infiniband_devices():
        r.add(
            "ulimit -l",
            FAIL,
            f"locked memory limited to {soft / 2**20:.0f} MiB on a host with InfiniBand "
            f"({', '.join(infiniband_devices())}): NCCL registers its RDMA buffers as locked memory and fails, or "
            "falls back to sockets",
            "'* - memlock unlimited' in /etc/security/limits.conf (docker: --ulimit memlock=-1), then log in again",
        )
    else:
        r.add(
            "ulimit -l",
            WARN,
            f"locked memory limited to {soft / 2**20:.0f} MiB: pinned offload buffers and RDMA may fail",
            "'* - memlock unlimited' in /etc/security/limits.conf (docker: --ulimit memlock=-1)",
        )
    try:
        st = os.statvfs("/dev/shm")
        shm = st.f_frsize * st.f_blocks
    except OSError:
        shm = 0
    r.facts["shm_bytes"] = shm
    if shm < 256 * 2**20:
        r.add(
            "/dev/shm",
            FAIL,
            f"{shm / 2**20:.0f} MiB: NCCL and DeepSpeed's shared-memory ops fail",
            "docker run --shm-size=16g (or --ipc=host); mount -o remount,size=16G /dev/shm",
        )
    elif shm < 2 * GIB:
        r.add("/dev/shm", WARN, f"{shm / GIB:.1f} GiB: small for several ranks", "remount /dev/shm larger (16G)")
    else:
        r.add("/dev/shm", PASS, f"{shm / GIB:.0f} GiB")


def memory_and_disk(r: Report, needs: Needs) -> None:
    avail = _mem_available()
    r.facts["ram_available_bytes"] = avail
    if needs.host_ram_bytes and avail is not None:
        ok = avail >= needs.host_ram_bytes
        r.add(
            "host RAM",
            PASS if ok else FAIL,
            f"{avail / 1e9:,.0f} GB available, the plan needs {needs.host_ram_bytes / 1e9:,.0f} GB per node",
            "" if ok else "free memory, or offload less (pipeline plan --config ... shows what fits)",
        )
    else:
        why = "no plan of the config to compare with" if needs.run_dir else "give --config to compare with the plan"
        r.add("host RAM", PASS, f"{(avail or 0) / 1e9:,.0f} GB available ({why})")
    if needs.run_dir:
        folder = nearest_existing(Path(needs.run_dir))
        free = shutil.disk_usage(folder).free
        need = needs.disk_bytes  # every host: a node-local run_dir holds each node's share
        ok = need is None or free >= need
        r.add(
            "disk",
            PASS if ok else FAIL,
            f"{free / 1e9:,.0f} GB free at {folder}" + (f"; two checkpoints need {need / 1e9:,.1f} GB" if need else ""),
            "" if ok else "free space, lower checkpoint.keep_last, or put run_dir on a larger disk",
        )
    if needs.nvme_path:
        p = Path(needs.nvme_path)
        if not p.is_dir() or not os.access(p, os.W_OK):
            r.add("nvme", FAIL, f"{p}: not a writable folder", "create it on the local NVMe drive of every host")
        else:
            free = shutil.disk_usage(p).free
            ok = not needs.nvme_bytes or free >= needs.nvme_bytes
            r.add(
                "nvme",
                PASS if ok else FAIL,
                f"{free / 1e9:,.0f} GB free at {p}"
                + (f"; offload needs {needs.nvme_bytes / 1e9:,.0f} GB" if needs.nvme_bytes else ""),
                "" if ok else "a larger NVMe drive, or offload to CPU",
            )


def data(r: Report, needs: Needs) -> None:
    if not needs.data_path:
        return
    manifest = Path(needs.data_path) / "manifest.json"
    try:
        m = json.loads(manifest.read_text())
        r.facts["data_fingerprint"] = m["fingerprint"]
        r.add("data", PASS, f"{needs.data_path}: shards {m['fingerprint'][:12]}")
    except (OSError, ValueError, KeyError) as e:
        r.facts["data_fingerprint"] = None
        r.add(
            "data",
            FAIL,
            f"{manifest}: not readable here ({type(e).__name__})",
            "copy the shard folder to the same path on every host (or use a shared mount)",
        )


def master_port(r: Report, port: int | None) -> None:
    if port is None:
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            r.add("master port", PASS, f"{port} free")
        except OSError:
            r.add(
                "master port",
                FAIL,
                f"{port} in use on the first host (another run?)",
                "stop it, or, for a run in another run folder, pass --master-port with a free port (one folder "
                "takes one live run: a second launch into it is refused whatever its port)",
            )


def cpu_binding(r: Report) -> None:
    cores = os.cpu_count() or 1
    if shutil.which("numactl"):
        r.add("numactl", PASS, f"found: CPU Adam ranks are bound to their share of the {cores} cores")
    else:
        r.add(
            "numactl",
            FAIL,
            "not installed: the launch binds CPU-Adam ranks to cores with numactl (--bind_cores_to_rank), "
            "which fails on a host without it",
            "apt-get install numactl on every host",
        )


def run_checks(needs: Needs, *, first: bool = True, quick: bool = False) -> Report:
    """All checks of this host. `quick`: only those that take no import of torch or deepspeed (what `pipeline
    pretrain` runs before every launch)."""
    r = Report(socket.gethostname())
    limits(r, needs)
    memory_and_disk(r, needs)
    shared_run_dir(r, needs)
    data(r, needs)
    if first:
        master_port(r, needs.master_port)
    if quick:
        return r
    python_and_versions(r)
    if needs.cpu_adam:
        cpu_binding(r)
    gpu = accelerator(r)
    deepspeed_ops(r, needs, gpu)
    network(r, needs)
    return r


def quick_checks(needs: Needs) -> tuple[list[str], list[str]]:
    """The quick checks as `pipeline pretrain` runs them before every launch: (the lines to show, one per WARN and
    FAIL; the problems, one per FAIL, which join the launch's one error unless --skip-doctor)."""
    shown, failed = [], []
    for c in run_checks(needs, quick=True).checks:
        if c.status in (WARN, FAIL):
            shown.append(f"doctor: {c.status} {c.name}: {c.detail}" + (f" ({c.fix})" if c.fix else ""))
        if c.status == FAIL:
            failed.append(
                f"the local check '{c.name}' failed ({c.detail}); fix it, or launch anyway with --skip-doctor"
            )
    return shown, failed


def _addresses() -> list[str]:
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
        return out.split()
    except (OSError, subprocess.SubprocessError):
        return []


def _route_interface(addr: str) -> str | None:
    try:
        out = subprocess.run(["ip", "route", "get", addr], capture_output=True, text=True, timeout=5).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[out.index("dev") + 1] if "dev" in out else None


def _link_speed_mbps(iface: str) -> int | None:
    try:
        speed = int(Path(f"/sys/class/net/{iface}/speed").read_text().strip())
    except (OSError, ValueError):
        return None
    return speed if speed > 0 else None


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def nearest_existing(p: Path) -> Path:
    """`p`, or the nearest folder above it that exists (where a folder not made yet will be)."""
    p = p.absolute()
    while not p.exists():
        p = p.parent
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="pipeline doctor's checks on this host, as JSON")
    ap.add_argument("--needs", default="{}", help="JSON of pipeline.doctor.checks.Needs")
    ap.add_argument("--not-first", action="store_true")
    args = ap.parse_args(argv)
    report = run_checks(Needs(**json.loads(args.needs)), first=not args.not_first)
    print("DOCTOR-JSON " + json.dumps(report.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
