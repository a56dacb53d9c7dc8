"""`pipeline doctor` on this machine, `--write-env` keeping the user's lines, and `pipeline pretrain` stopping on a
failed quick check. The cross-host checks run in tests/multiproc/test_doctor.py (network namespaces)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.doctor.cluster import write_env
from tests.multiproc.launch import free_port


def test_local_doctor_lists_each_check_and_passes_here() -> None:
    # A free master port of this test's own: the default 29500 may be a run's beside the tests (the port check's
    # FAIL on a taken port: test_pretrain_stops_on_a_failed_local_check_unless_skipped)
    port = ["--master-port", str(free_port())]
    res = CliRunner().invoke(main, ["doctor", *port])
    assert res.exit_code == 0, res.output
    for name in (
        "ulimit -l",
        "/dev/shm",
        "host RAM",
        "master port",
        "versions",
        "accelerator",
        "deepspeed ops",
        "network",
    ):
        assert any(line.split("  ")[1:2] and name in line for line in res.output.splitlines()), name
    assert "0 FAIL" in res.output
    as_json = CliRunner().invoke(main, ["doctor", "--json", *port])
    (report,) = json.loads(as_json.output)
    assert {c["status"] for c in report["checks"]} <= {"PASS", "WARN"}
    assert report["facts"]["versions"]["deepspeed"]


def test_write_env_adds_findings_and_keeps_the_users_lines(tmp_path: Path) -> None:
    env = tmp_path / ".deepspeed_env"
    env.write_text("HF_HOME=/data/hf\nNCCL_SOCKET_IFNAME=ens1f0\n\nPYTHONPATH=/opt/x=y\n")
    notes = write_env(env, {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1"})
    lines = env.read_text().splitlines()
    assert lines == [
        "HF_HOME=/data/hf",
        "NCCL_SOCKET_IFNAME=ens1f0",
        "PYTHONPATH=/opt/x=y",
        "GLOO_SOCKET_IFNAME=eth0",
        "NCCL_IB_DISABLE=1",
    ]
    assert "kept your NCCL_SOCKET_IFNAME=ens1f0 (the checks found eth0)" in notes
    # DeepSpeed's launcher reads each line as KEY=VALUE (runner.py): no blank line or comment may be left.
    assert all(len(line.split("=", maxsplit=1)) == 2 for line in lines)
    assert write_env(env, {"NCCL_IB_DISABLE": "1"}) == [] and env.read_text().splitlines() == lines


def test_pretrain_stops_on_a_failed_local_check_unless_skipped(shards: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"run_dir: {tmp_path}/run\ndata: {{path: {shards}}}\nbatch: {{micro_batch_size: 2, "
        "global_batch_size: 8}\ntrain: {max_steps: 3, precision: fp32}\n"
    )
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        args = ["pretrain", "--config", str(cfg), "--num-gpus", "2", "--master-port", port]
        res = CliRunner().invoke(main, args)  # a launch: refused before the launcher starts
        assert res.exit_code == 2, res.output
        assert f"FAIL master port: {port} in use" in res.output and "--skip-doctor" in res.output
        res = CliRunner().invoke(main, [*args, "--dry-run"])  # a dry run starts nothing: the port is not its concern
        assert res.exit_code == 0, res.output
        assert '"train_batch_size": 8' in res.output and "master port" not in res.output


def test_config_checks_data_disk_and_ram_and_hosts_are_compared(shards: Path, tmp_path: Path) -> None:
    from pipeline.doctor.checks import Report
    from pipeline.doctor.cluster import _compare

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"run_dir: {tmp_path}/run\ndata: {{path: {shards}}}\nbatch: {{micro_batch_size: 2, "
        "global_batch_size: 8}\ntrain: {max_steps: 3, precision: fp32}\n"
    )
    port = str(free_port())
    res = CliRunner().invoke(main, ["doctor", "--config", str(cfg), "--json", "--master-port", port])
    assert res.exit_code == 0, res.output
    (report,) = json.loads(res.output[res.output.index("[") :])
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["data"]["status"] == "PASS" and "two checkpoints need" in checks["disk"]["detail"]
    assert "the plan needs" in checks["host RAM"]["detail"]
    fingerprint = report["facts"]["data_fingerprint"]
    a, b = Report("a"), Report("b")
    a.facts = {
        "versions": {"deepspeed": "0.19.8"},
        "python": "/v/bin/python",
        "python_version": "3.11.7",
        "data_fingerprint": fingerprint,
    }
    b.facts = {**a.facts, "data_fingerprint": "0" * 16}
    _compare(["a", "b"], {"a": a, "b": b})
    same = {c.name: c for c in b.checks}
    assert same["same as first host"].status == "PASS"
    assert same["same data"].status == "FAIL" and fingerprint[:12] in same["same data"].detail


def test_nccl_over_plain_ethernet_gets_more_sockets() -> None:
    """Two GPU hosts without InfiniBand: NCCL's TCP transport gets 4 threads x 4 sockets (its docs' advice for a
    generic 100 Gbps network) besides NCCL_IB_DISABLE; hosts with InfiniBand get neither."""
    from pipeline.doctor.checks import Report
    from pipeline.doctor.cluster import env_findings

    def host(name: str, ib: bool) -> Report:
        r = Report(name)
        r.facts.update(infiniband=ib, gpus=[{"name": "NVIDIA GeForce RTX 4090 D"}], interface="enp65s0f0")
        return r

    found = env_findings([host("a", False), host("b", False)])
    assert found["NCCL_IB_DISABLE"] == "1" and found["NCCL_SOCKET_NTHREADS"] == "4"
    assert found["NCCL_NSOCKS_PERTHREAD"] == "4"
    assert "NCCL_SOCKET_NTHREADS" not in env_findings([host("a", True), host("b", True)])


def test_slots_above_a_hosts_usable_gpus_fail_naming_the_host_and_the_fix() -> None:
    """F3 of the multi-node review: a dead card (3 GPUs seen for slots=4) and a card another job holds (4 seen,
    one with 2% free) fail before a launch that would end in "invalid device ordinal" after a 30-minute wait."""
    from pipeline.doctor.checks import Report
    from pipeline.doctor.cluster import slots_vs_gpus

    def card(free: float) -> dict[str, float]:
        return {"name": "NVIDIA GeForce RTX 4090 D", "memory_bytes": 24e9, "free_bytes": free * 24e9}

    reports = {h: Report(h) for h in ("n1", "n2", "n3")}
    reports["n1"].facts["gpus"] = [card(0.98)] * 4
    reports["n2"].facts["gpus"] = [card(0.98)] * 3
    reports["n3"].facts["gpus"] = [card(0.98)] * 3 + [card(0.02)]
    slots_vs_gpus({"n1": 4, "n2": 4, "n3": 4}, reports)
    got = {h: r.checks[-1] for h, r in reports.items()}
    assert got["n1"].status == "PASS"
    assert got["n2"].status == "FAIL" and "slots=4, and it has 3 GPU(s)" in got["n2"].detail
    assert "set slots=3 for n2" in got["n2"].fix
    assert got["n3"].status == "FAIL" and "1 of its 4 GPUs have less than 50% of their memory free" in got["n3"].detail
    cpu = {"a": Report("a")}
    cpu["a"].facts["gpus"] = []
    slots_vs_gpus({"a": 2}, cpu)  # CPU ranks (the test clusters): nothing to compare
    assert not cpu["a"].checks


def test_a_run_dir_the_launching_machine_wrote_in_must_be_seen_by_every_host(tmp_path: Path) -> None:
    """F1/F5 of the multi-node review: the doctor writes a file into run_dir from the launching machine; a host
    whose run_dir is its own disk does not see it and fails, naming the launching machine and the fix."""
    from pipeline.doctor.checks import Needs, Report, shared_run_dir
    from pipeline.doctor.cluster import _write_shared_probe

    probe = _write_shared_probe(str(tmp_path / "runs" / "new"))  # not made yet: the folder it will be made in
    assert probe is not None and probe.parent == tmp_path and probe.is_file()
    seen, unseen = Report("node0"), Report("node1")
    shared_run_dir(seen, Needs(run_dir="runs/new", shared_probe=str(probe), launcher_host="login"))
    shared_run_dir(unseen, Needs(run_dir="runs/new", shared_probe=str(tmp_path / "other"), launcher_host="login"))
    assert seen.checks[-1].status == "PASS"
    assert unseen.checks[-1].status == "FAIL" and "written from login, is not visible here" in unseen.checks[-1].detail
    assert "storage every node mounts at the same path" in unseen.checks[-1].fix


def test_locked_memory_limited_on_an_infiniband_host_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """F5: NCCL registers its RDMA buffers as locked memory; a 64 KiB limit (docker's default) on an InfiniBand
    host fails the run or drops it to sockets, so it is a FAIL there, not a warning."""
    import resource

    from pipeline.doctor import checks

    (tmp_path / "mlx5_0").mkdir()
    monkeypatch.setattr(checks, "infiniband_devices", lambda root="": ["mlx5_0"])
    monkeypatch.setattr(resource, "getrlimit", lambda what: (64 * 1024, 64 * 1024))
    r = checks.Report("node0")
    checks.limits(r, checks.Needs())
    memlock = next(c for c in r.checks if c.name == "ulimit -l")
    assert memlock.status == "FAIL" and "InfiniBand (mlx5_0)" in memlock.detail
    assert checks.infiniband_devices(str(tmp_path)) == ["mlx5_0"]


def test_every_host_is_checked_for_room_for_the_checkpoints(tmp_path: Path) -> None:
    """F5: with node-local disks every node holds its share of each checkpoint; the disk check ran on the first
    host only."""
    from pipeline.doctor.checks import Needs, run_checks

    r = run_checks(Needs(run_dir=str(tmp_path), disk_bytes=1e18), first=False, quick=True)
    disk = next(c for c in r.checks if c.name == "disk")
    assert disk.status == "FAIL" and "two checkpoints need" in disk.detail
