"""`pipeline doctor`: the checks of pipeline.doctor.checks on this machine or on every host of a hostfile, reached
as DeepSpeed's launcher reaches them (ssh without a password, the launcher's environment exports and
.deepspeed_env, `cd` to this folder, this Python), in parallel, each step with a timeout; then what only a
comparison shows (another Python, venv or version than the first host's, other data) and a short all-reduce
between the hosts. `--write-env` puts what was found into .deepspeed_env.

One job: reaching the hosts and comparing them; each host's own checks are pipeline.doctor.checks (a module that
must run alone on a host, standard library only), which is why the two are apart and neither is smaller."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from pipeline.atomic import write_text
from pipeline.doctor.checks import FAIL, PASS, WARN, Check, Needs, Report, nearest_existing, run_checks
from pipeline.doctor.remote import Reach, ask_every, last_line, parse_tagged, remote_python, slurm_step, ssh
from pipeline.errors import PipelineError
from pipeline.plan.facts import cluster_from_flags
from pipeline.plan.hostfile import expand_hostlist, hostfile_facts
from pipeline.units import parse_gbps


def doctor(
    hosts: list[str] | None,
    needs: Needs,
    *,
    timeout: float = 60.0,
    expected_bus_bytes: float | None = None,
    bandwidth_mbytes: float = 16.0,
    slots: dict[str, int] | None = None,
    reach: Reach = ssh,
) -> list[Report]:
    """Reports for this machine (hosts None) or for each host, in order; `slots`: the hostfile's, compared with
    each host's usable GPUs; `reach`: how a host is reached (ssh, or a Slurm job step: then no pdsh is needed)."""
    if not hosts:
        return [run_checks(needs)]
    reports = {h: Report(h) for h in hosts}
    launcher = Report("launcher (this machine)")
    if reach is ssh:
        ok = shutil.which("pdsh") is not None
        launcher.add(
            "pdsh",
            PASS if ok else FAIL,
            "found" if ok else "not on PATH: DeepSpeed's multi-node launcher runs pdsh here",
            "" if ok else "apt-get install pdsh",
        )
    reachable = _reach(reports, timeout, reach)
    if not reachable:
        return [launcher, *reports.values()]
    master = reports[reachable[0]].facts["addresses"][0]  # as DeepSpeed picks it: the first host's `hostname -I`
    probe = _write_shared_probe(needs.run_dir)
    needs = replace(needs, shared_probe=str(probe) if probe else None, launcher_host=socket.gethostname())

    def checks(h: str) -> tuple[str, Any, str]:
        first = h == hosts[0]
        peer = reports[reachable[1]].facts["addresses"][0] if first and len(reachable) > 1 else master
        n = Needs(
            **{
                **asdict(needs),
                "peer": peer if len(reachable) > 1 else None,
                "master_port": needs.master_port if first else None,
            }
        )
        args = ["--needs", json.dumps(asdict(n))] + ([] if first else ["--not-first"])
        res = reach(h, remote_python("pipeline.doctor.checks", args), timeout)
        return (
            h,
            parse_tagged("DOCTOR-JSON", res.stdout),
            (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1],
        )

    with ThreadPoolExecutor(len(reachable)) as pool:
        for h, got, err in pool.map(checks, reachable):
            if got is None:
                reports[h].add(
                    "checks",
                    FAIL,
                    f"the checks did not run there: {err}",
                    f"run `{sys.executable} -m pipeline.doctor.checks` on {h} to see why; the same venv "
                    "path must exist on every host",
                )
                continue
            reports[h].checks += [Check(**c) for c in got["checks"]]
            reports[h].facts.update(got["facts"])
    if probe:
        probe.unlink(missing_ok=True)
    _compare(hosts, reports)
    slots_vs_gpus(slots or {}, reports)
    ran = [h for h in reachable if "versions" in reports[h].facts]
    if len(ran) > 1:  # rank 0 on the first host whose checks ran, at its first address
        first = reports[ran[0]].facts["addresses"][0]
        ranks = [(h, local) for h in ran for local in range((slots or {}).get(h, 1))]
        _bandwidth(ranks, reports, first, timeout, expected_bus_bytes, bandwidth_mbytes, reach)
    return [launcher, *reports.values()]


def _reach(reports: dict[str, Report], timeout: float, reach: Reach = ssh) -> list[str]:
    """The hosts that answer (over ssh as DeepSpeed's launcher reaches them, or as Slurm job steps), their
    addresses recorded, in order; a FAIL with the reason on each other one."""
    reachable = []
    how = "ssh" if reach is ssh else "srun"
    for h, res in ask_every(list(reports), "hostname -I", timeout, reach).items():
        if res.returncode == 0 and res.stdout.split():
            reports[h].add(how, PASS, "reachable without a password" if reach is ssh else "a job step runs there")
            reports[h].facts["addresses"] = res.stdout.split()
            reachable.append(h)
        elif reach is ssh:
            reports[h].add(
                "ssh",
                FAIL,
                f"{h} not reachable by ssh without a password: {last_line(res)}",
                "ssh-copy-id to it from this machine; check its name resolves (~/.ssh/config, /etc/hosts)",
            )
        else:
            reports[h].add(
                "srun",
                FAIL,
                f"no job step ran on {h}: {last_line(res)}",
                f"check the node's state (`scontrol show node {h}`) and that this runs inside the allocation",
            )
    return reachable


def _write_shared_probe(run_dir: str | None) -> Path | None:
    """A file in run_dir (or the nearest folder above it that exists) that every host must see: the run folder
    has to be one folder shared by all nodes (pipeline.train.checkpoint.files.unshared_hosts)."""
    if not run_dir:
        return None
    probe = nearest_existing(Path(run_dir)) / f".pipeline-doctor-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.write_text("written by pipeline doctor on the launching machine\n")
    except OSError:
        return None  # the disk check says what is wrong with the folder
    return probe


def _compare(hosts: list[str], reports: dict[str, Report]) -> None:
    ref = reports[hosts[0]].facts
    if "versions" not in ref:
        return
    for h in hosts[1:]:
        f = reports[h].facts
        if "versions" not in f:
            continue
        diffs = [
            f"{k} {f['versions'].get(k)} here, {v} on {hosts[0]}"
            for k, v in ref["versions"].items()
            if f["versions"].get(k) != v
        ]
        if f.get("python") != ref.get("python") or f.get("python_version") != ref.get("python_version"):
            diffs.append(
                f"python {f.get('python')} ({f.get('python_version')}) here, {ref.get('python')} "
                f"({ref.get('python_version')}) on {hosts[0]}"
            )
        if diffs:
            reports[h].add(
                "same as first host",
                FAIL,
                "; ".join(diffs),
                "install the same venv at the same path on every host (make install)",
            )
        else:
            reports[h].add("same as first host", PASS, "python, venv and versions match")
        if "data_fingerprint" in ref and f.get("data_fingerprint") != ref["data_fingerprint"]:
            reports[h].add(
                "same data",
                FAIL,
                f"shards {str(f.get('data_fingerprint'))[:12]} here, {str(ref['data_fingerprint'])[:12]} on {hosts[0]}",
                "copy the same shard folder to every host (rsync -a), or use a shared mount",
            )


USABLE_FREE_SHARE = 0.5
"""A GPU with less than this share of its memory free is held by another process: not usable for a rank."""


def slots_vs_gpus(slots: dict[str, int], reports: dict[str, Report]) -> None:
    """Each host's hostfile slots against the GPUs its checks found, and how many of them are free: a slot above
    them (a dead card, a card another job holds) ends the launch in "invalid device ordinal" or an out-of-memory
    error, after the peers have waited a collective timeout. A cluster whose hosts show no GPU at all runs CPU
    ranks (tests): nothing to compare."""
    if not any(r.facts.get("gpus") for r in reports.values()):
        return
    for host, want in slots.items():
        r = reports.get(host)
        if r is None or "gpus" not in r.facts:
            continue
        gpus = r.facts["gpus"]
        usable = [g for g in gpus if g.get("free_bytes", g["memory_bytes"]) >= USABLE_FREE_SHARE * g["memory_bytes"]]
        if want > len(gpus):
            r.add(
                "slots",
                FAIL,
                f"the hostfile gives {host} slots={want}, and it has {len(gpus)} GPU(s)",
                f"set slots={len(gpus)} for {host} in the hostfile, or bring the missing card back (nvidia-smi)",
            )
        elif want > len(usable):
            busy = len(gpus) - len(usable)
            r.add(
                "slots",
                FAIL,
                f"the hostfile gives {host} slots={want}; {busy} of its {len(gpus)} GPUs have less than "
                f"{USABLE_FREE_SHARE:.0%} of their memory free (another process holds them)",
                f"stop what holds them (nvidia-smi lists it), or set slots={len(usable)} for {host}",
            )
        else:
            r.add("slots", PASS, f"slots={want}: {len(usable)} GPU(s) free of {len(gpus)}")


def _link_speeds(hosts: list[str], reports: dict[str, Report], expected: float | None) -> None:
    """A WARN on each host whose interface is slower than the hostfile's network."""
    if not expected:
        return
    for h in hosts:
        f = reports[h].facts
        if f.get("link_mbps") and f["link_mbps"] * 1e6 / 8 < 0.9 * expected:
            reports[h].add(
                "link speed",
                WARN,
                f"{f['interface']} is a {f['link_mbps'] / 1000:g} Gbps link; the "
                f"hostfile says {expected * 8 / 1e9:g} Gbps",
                "if a faster interface exists, NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME=<it>",
            )


def rendezvous_port(lo: int = 20000, hi: int = 32000) -> int:
    """A free TCP port in [lo, hi), below the kernel's ephemeral range (32768 and up on Linux): a port that bind(0)
    found free lies in that range, and the next outgoing connection of any process (gloo opens many) can take it
    before the rendezvous binds it."""
    import random

    for _ in range(500):
        port = random.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise PipelineError(f"no free TCP port in {lo}-{hi} on this host for the rendezvous")


def _bandwidth(
    ranks: list[tuple[str, int]],
    reports: dict[str, Report],
    master: str,
    timeout: float,
    expected: float | None,
    mbytes: float,
    reach: Reach = ssh,
) -> None:
    """An all-reduce with one process per hostfile slot (host, local rank), as the run will place its ranks: the
    path between a node's own GPUs (P2P, or through host memory without it) is exercised with the network's."""
    hosts = list(dict.fromkeys(h for h, _ in ranks))

    port = rendezvous_port()  # free here, and very likely on the first host

    def rank(i: int) -> subprocess.CompletedProcess:
        host, local = ranks[i]
        args = [
            "--rank",
            str(i),
            "--local-rank",
            str(local),
            "--world",
            str(len(ranks)),
            "--master",
            f"{master}:{port}",
            "--mbytes",
            str(mbytes),
            "--timeout",
            str(timeout),
        ]
        iface = reports[host].facts.get("interface")
        return reach(
            host,
            remote_python("pipeline.doctor.bandwidth", args + (["--iface", iface] if iface else [])),
            timeout + 30,
        )

    _link_speeds(hosts, reports, expected)
    with ThreadPoolExecutor(len(ranks)) as pool:
        results = list(pool.map(rank, range(len(ranks))))
    got = parse_tagged("DOCTOR-BW", results[0].stdout)
    first = reports[hosts[0]]
    if got is None:
        errs = "; ".join(f"{h}: {last_line(r)}" for (h, _), r in zip(ranks, results, strict=True) if r.returncode != 0)
        first.add(
            "all-reduce",
            FAIL,
            f"between {', '.join(hosts)} failed: {errs or 'no result'}",
            "check the interface (NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME) and firewalls between the hosts",
        )
        return
    bus = got["bus_bytes_per_s"]
    first.facts["allreduce_bus_bytes_per_s"] = bus
    detail = (
        f"{got['backend']} all-reduce of {got['bytes'] / 2**20:.0f} MiB over {len(hosts)} hosts, "
        f"{len(ranks)} ranks: "
        f"{bus / 1e9:.3g} GB/s bus bandwidth ({bus * 8 / 1e9:.3g} Gbps)"
    )
    if expected:
        detail += f"; the hostfile says {expected * 8 / 1e9:g} Gbps"
        if bus < 0.3 * expected:
            first.add(
                "all-reduce",
                WARN,
                detail + ": under 30% of it",
                "check that the interface found is the fast one (not a 1 GbE management port)",
            )
            return
    first.add("all-reduce", PASS, detail)


def needs_for_config(config_path: str, sets: list[str], cluster: Any, master_port: int) -> tuple[Needs, str | None]:
    """What the config's run needs of each host: its folders, NVMe path, and the plan's host RAM, room for two
    checkpoints and NVMe bytes on `cluster`; with a note when the plan cannot be made (no shards yet)."""
    from pipeline.train import forecast
    from pipeline.train.setup.config import load
    from pipeline.train.setup.ds_config import load_ds_config, offload_devices

    cfg = load(config_path, sets)
    needs = Needs(run_dir=cfg.run_dir, data_path=cfg.data.path, master_port=master_port)
    if cfg.train.deepspeed_config != "auto":
        offload = offload_devices(load_ds_config(cfg.train.deepspeed_config))
        needs.cpu_adam = offload.optimizer != "none"
        if offload.nvme:
            needs.uses_nvme, needs.nvme_path = True, (offload.nvme_paths or (None,))[-1]
    try:
        est = forecast.forecast_config(
            config_path, sets, cluster, seq_len=None, layers=None, vocab_size=32000, mfu=0.4
        ).yours
    except PipelineError as e:
        return needs, f"no plan for {config_path} ({e}); RAM and checkpoint room not compared"
    needs.host_ram_bytes = est.host["total"]
    needs.disk_bytes = 2 * est.checkpoint["per_node"] if cfg.checkpoint.enabled else None
    needs.nvme_bytes = est.nvme_bytes or None
    return needs, None


def env_findings(reports: list[Report]) -> dict[str, str]:
    """What .deepspeed_env should say: the interface collectives use, P2P off where it hangs, no InfiniBand."""
    found: dict[str, str] = {}
    ifaces = sorted({r.facts["interface"] for r in reports if r.facts.get("interface")})
    if ifaces:
        found["NCCL_SOCKET_IFNAME"] = found["GLOO_SOCKET_IFNAME"] = ",".join(ifaces)
    if any(r.facts.get("advise_p2p_disable") for r in reports):
        found["NCCL_P2P_DISABLE"] = "1"
    hosts = [r for r in reports if "infiniband" in r.facts]
    if hosts and not any(r.facts["infiniband"] for r in hosts):
        found["NCCL_IB_DISABLE"] = "1"
        if len(hosts) > 1 and any(r.facts.get("gpus") for r in hosts):
            # NCCL over plain TCP: one socket and one thread per connection by default; NCCL's docs suggest 4 x 4
            # for a generic 100 Gbps network (their product stays within NCCL's limit of 64).
            found["NCCL_SOCKET_NTHREADS"] = "4"
            found["NCCL_NSOCKS_PERTHREAD"] = "4"
    return found


def write_env(path: Path, found: dict[str, str]) -> list[str]:
    """Add `found` to the env file, keeping every line already there: a variable the user set is never changed (a
    different finding is returned as a note). DeepSpeed reads every line as KEY=VALUE, so no comments are written.
    Returns what was added and what was kept."""
    lines = path.read_text().splitlines() if path.exists() else []
    have = {}
    for line in lines:
        key, sep, value = line.partition("=")
        if sep:
            have[key.strip()] = value.strip()
    notes = []
    for key, value in found.items():
        if key not in have:
            lines.append(f"{key}={value}")
            notes.append(f"added {key}={value}")
        elif have[key] != value:
            notes.append(f"kept your {key}={have[key]} (the checks found {value})")
    write_text(path, "".join(f"{line}\n" for line in lines if line.strip()))
    return notes


def table(reports: list[Report]) -> str:
    rows = [
        (r.host, c.name, c.status, c.detail + (f"  -> {c.fix}" if c.fix and c.status != PASS else ""))
        for r in reports
        for c in r.checks
    ]
    wh = max([len(r[0]) for r in rows] + [4])
    wc = max([len(r[1]) for r in rows] + [5])
    out = [f"{'host':<{wh}}  {'check':<{wc}}  status  detail"]
    out += [f"{h:<{wh}}  {c:<{wc}}  {s:<6}  {d}" for h, c, s, d in rows]
    fails = sum(r[2] == FAIL for r in rows)
    warns = sum(r[2] == WARN for r in rows)
    out.append(f"\n{fails} FAIL, {warns} WARN, {len(rows) - fails - warns} PASS")
    return "\n".join(out)


def failed(reports: list[Report]) -> bool:
    return any(c.status == FAIL for r in reports for c in r.checks)


def run(
    hostfile: str | None,
    config: str | None,
    sets: list[str],
    master_port: int,
    timeout: float,
    say: Any,
    slurm: bool = False,
) -> list[Report]:
    """`pipeline doctor`: every host of `hostfile` (this machine without one; with `slurm`, every node of this
    Slurm allocation, reached as job steps) checked for what the config's run needs of it, planned for the
    hostfile's cluster (its `# cluster:` facts, else the planner's defaults; the master port alone without a
    config), then compared and an all-reduce measured against the hostfile's network fact."""
    from pipeline.plan.hostfile import hostfile_hosts

    if slurm:
        return _in_slurm(config, sets, master_port, timeout, say)
    needs, note = Needs(master_port=master_port), None
    if config:
        needs, note = needs_for_config(config, sets, cluster_from_flags(hostfile, 1, 1, {})[0], master_port)
    if note:
        say(f"note: {note}")
    slots = dict(hostfile_hosts(hostfile)) if hostfile else None
    net = hostfile_facts(hostfile).get("network") if hostfile else None
    expected = parse_gbps(net) * 1e9 / 8 if net else None
    return doctor(list(slots) if slots else None, needs, timeout=timeout, expected_bus_bytes=expected, slots=slots)


def _in_slurm(config: str | None, sets: list[str], master_port: int, timeout: float, say: Any) -> list[Report]:
    """`pipeline doctor --slurm`, inside an allocation (`salloc`, or a job script): its nodes reached as job steps
    (`srun --overlap`), one rank each in the all-reduce."""
    nodes = os.environ.get("SLURM_JOB_NODELIST")
    if not nodes:
        raise PipelineError(
            "--slurm: no SLURM_JOB_NODELIST here: run it inside the allocation (`salloc -N 8` then `pipeline doctor "
            "--slurm ...`, or as a line of the job script)"
        )
    needs, note = Needs(master_port=master_port), None
    if config:
        needs, note = needs_for_config(config, sets, cluster_from_flags(None, 1, 1, {})[0], master_port)
    if note:
        say(f"note: {note}")
    return doctor(expand_hostlist(nodes), needs, timeout=timeout, reach=slurm_step)


def write_found_env(reports: list[Report]) -> list[str]:
    """`--write-env`: what the checks found, added to the last env file DeepSpeed reads; one line per change."""
    from pipeline.train.runtime.env import env_file_paths

    target = Path(env_file_paths()[-1])
    return [f"{target}: {note}" for note in write_env(target, env_findings(reports)) or ["nothing to add"]]
