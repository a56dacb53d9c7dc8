"""`pipeline pretrain` started by a scheduler: through a real Slurm (two slurmd nodes on this machine, the job script
`pipeline pretrain --sbatch` writes, `sbatch`, `scancel`, a requeue), and by hand on two hosts without ssh (network
namespaces, NNODES/NODE_RANK/MASTER_ADDR as torchrun or a JobSet set them). Every step's loss equals the one
machine launch's with the same two ranks."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.train.checkpoint import files as ckpt
from tests.multiproc import launch, netns, slurm

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("scheduler")]  # one Slurm cluster, one reference
ROOT = Path(__file__).resolve().parents[2]
PIPELINE = str(Path(sys.executable).parent / "pipeline")
KW = dict(ds_config="zero2.json", micro=1, global_batch=4, steps=16, ckpt_interval=8)


@pytest.fixture(scope="module")
def reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of the same run launched on this machine with two ranks."""
    work = tmp_path_factory.mktemp("sched_ref")
    out = launch.run(launch.write_config(work / "ref.yaml", run_dir=work / "ref", shards=shards, **KW))  # type: ignore[arg-type]
    assert out.returncode == 0, out.stderr[-3000:]
    losses = launch.losses(work / "ref")
    assert sorted(losses) == list(range(1, 17))
    return losses


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with slurm.cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def _same(run_dir: Path, reference: dict[int, float]) -> None:
    losses = launch.losses(run_dir)
    assert sorted(losses) == sorted(reference)
    bad = [(s, losses[s], reference[s]) for s in reference if abs(losses[s] - reference[s]) > 1e-4]
    assert not bad, bad


def _job_script(cluster: dict, config: Path, name: str, *more: str) -> Path:
    script = cluster["work"] / f"{name}.sh"
    cmd = [PIPELINE, "pretrain", "--config", str(config), "--sbatch", str(script), "--nodes", "2", *more]
    out = subprocess.run(cmd, env=cluster["env"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"submit it with: sbatch {script}" in out.stdout
    return script


def _output(script: Path, job_id: str) -> str:
    path = script.with_name(f"{script.stem}-{job_id}.out")
    return path.read_text() if path.exists() else ""


def _wait_step(run_dir: Path, step: int, cluster: dict, job_id: str, timeout: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if max(launch.losses(run_dir), default=0) >= step:
            return
        if slurm.job(job_id, cluster["env"]).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {job_id} ended early: {slurm.job(job_id, cluster['env'])}")
        time.sleep(0.3)
    raise AssertionError(f"step {step} not reached in {timeout:.0f} s")


def test_a_slurm_job_trains_as_one_machine_does_and_scancel_term_saves_and_stops_it(
    cluster: dict, shards: Path, reference: dict[int, float]
) -> None:
    """`sbatch` of the written script on two Slurm nodes: `scancel --signal=TERM` (what a time limit sends) stops
    it with a checkpoint of the step it was on and no requeue; the same script submitted again resumes there, and
    all 16 steps' losses are the one-machine launch's."""
    work, env = cluster["work"], cluster["env"]
    run_dir = work / "run"
    script = _job_script(cluster, launch.write_config(work / "c.yaml", run_dir=run_dir, shards=shards, **KW), "job")  # type: ignore[arg-type]
    first = slurm.submit(script, env)
    _wait_step(run_dir, 3, cluster, first)
    subprocess.run(["scancel", "--signal=TERM", first], env=env, check=True, timeout=60)
    fields = slurm.wait_job(first, env, ("COMPLETED", "FAILED", "CANCELLED"))
    said = _output(script, first)
    assert fields["Restarts"] == "0", said[-3000:]
    stopped = ckpt.latest_complete(run_dir)
    assert stopped is not None and 3 <= ckpt.read_marker(run_dir, stopped)["step"] < 16, said[-3000:]
    assert "launched by a scheduler: node 0 of 2 (node1, node2)" in said
    second = slurm.submit(script, env)
    fields = slurm.wait_job(second, env, ("COMPLETED", "FAILED", "CANCELLED"))
    said = _output(script, second)
    assert fields["JobState"] == "COMPLETED", said[-5000:]
    assert f"resumed from {run_dir / stopped}: step" in said, said[-3000:]
    assert ckpt.read_marker(run_dir, "step00000016")["world_size"] == 2
    _same(run_dir, reference)
    assert (run_dir / "logs" / "launch.log").is_file() and (run_dir / "logs" / "launch-node1.log").is_file()


def test_near_the_time_limit_a_requeue_job_saves_requeues_itself_and_resumes(
    cluster: dict, shards: Path, reference: dict[int, float]
) -> None:
    """The signal Slurm sends the batch shell before the time limit (`--signal=B:USR1@...`, sent here with
    `scancel --batch --signal=USR1`): the steps save and stop, the script requeues the job, and the requeued job
    (SLURM_RESTART_COUNT 1) resumes from that checkpoint to the end."""
    work, env = cluster["work"], cluster["env"]
    run_dir = work / "requeued"
    cfg = launch.write_config(work / "r.yaml", run_dir=run_dir, shards=shards, **KW)  # type: ignore[arg-type]
    script = _job_script(cluster, cfg, "requeue", "--requeue", "--time", "60")
    assert "#SBATCH --requeue" in script.read_text()
    job_id = slurm.submit(script, env)
    _wait_step(run_dir, 3, cluster, job_id)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=env, check=True, timeout=60)
    # Slurm holds a requeued job until the old job's credentials expire (cred_expire: 10 s in the test's cluster,
    # 120 s by default), then starts it again.
    t0 = time.time()
    while slurm.job(job_id, env).get("Restarts") != "1" and time.time() - t0 < 300:
        time.sleep(0.3)
    fields = slurm.wait_job(job_id, env, ("COMPLETED", "FAILED", "CANCELLED"))
    said = _output(script, job_id)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", said[-5000:]
    assert "requeueing job" in said and "requeued 1x" in said
    _same(run_dir, reference)


def test_a_node_lost_mid_run_requeues_the_job_onto_the_node_left_and_the_run_goes_on(
    cluster: dict, shards: Path, reference: dict[int, float]
) -> None:
    """A job written with `--requeue --min-nodes 1` (`#SBATCH --nodes=1-2`): node2 is lost mid-run (its slurmd and
    every process of the job on it killed). Slurm marks it down and requeues the job; the job starts on node1
    alone, says so, resumes the checkpoint of 2 ranks on 1 through the universal checkpoint with the same 4
    sequences per step, and every loss equals the one-machine launch's."""
    work, env = cluster["work"], cluster["env"]
    run_dir = work / "shrunk"
    cfg = launch.write_config(work / "s.yaml", run_dir=run_dir, shards=shards, **KW)  # type: ignore[arg-type]
    script = _job_script(cluster, cfg, "shrink", "--requeue", "--min-nodes", "1")
    assert "#SBATCH --nodes=1-2" in script.read_text()
    # Each micro-step 0.3 s longer: node2 is lost between the checkpoint of step 8 and the end (losses unchanged).
    job_id = slurm.submit(script, env | {"PIPELINE_FAULT_SLOW_MICRO_STEP": "0.3"})
    try:
        _wait_step(run_dir, 9, cluster, job_id)
        assert ckpt.latest_complete(run_dir) == "step00000008"
        assert len(slurm.lose_node(cluster, "node2")) > 1, "no process of the job found on node2"
        t0 = time.time()
        while slurm.job(job_id, env).get("Restarts") != "1" and time.time() - t0 < 300:
            time.sleep(0.3)
        fields = slurm.wait_job(job_id, env, ("COMPLETED", "FAILED", "CANCELLED"))
    finally:
        slurm.restart_node(cluster, "node2")
    said = _output(script, job_id)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", said[-5000:]
    assert "has 1 of the 2 nodes the run was planned for (--min-nodes 1): going on with 1 ranks, the same 4" in said
    assert "saved by 2 ranks, now 1: through the universal checkpoint" in said
    assert ckpt.read_marker(run_dir, "step00000016")["world_size"] == 1
    _same(run_dir, reference)


def test_the_doctor_checks_the_nodes_of_a_slurm_allocation_through_srun(cluster: dict, shards: Path) -> None:
    """`pipeline doctor --slurm --config C --json` as a line of a 2-node job script: both nodes reached as job
    steps (no ssh, no pdsh check), their checks run there, and an all-reduce measured between them."""
    import json

    work, env = cluster["work"], cluster["env"]
    cfg = launch.write_config(work / "d.yaml", run_dir=work / "doctor_run", shards=shards, **KW)  # type: ignore[arg-type]
    result = work / "doctor.json"
    script = work / "doctor.sh"
    script.write_text(
        f"#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --exclusive\n#SBATCH --output={work}/doctor-%j.out\n"
        f"cd {ROOT}\n{PIPELINE} doctor --slurm --config {cfg} --json --timeout 120 > {result}\necho doctor exit $?\n"
    )
    job_id = slurm.submit(script, env)
    slurm.wait_job(job_id, env, ("COMPLETED", "FAILED", "CANCELLED"))
    said = (work / f"doctor-{job_id}.out").read_text()
    reports = {r["host"]: {c["name"]: c for c in r["checks"]} for r in json.loads(result.read_text())}
    assert set(reports) == {"launcher (this machine)", "node1", "node2"}, said
    assert "pdsh" not in reports["launcher (this machine)"]
    for node in ("node1", "node2"):
        assert reports[node]["srun"]["status"] == "PASS", reports[node]
        assert reports[node]["versions"]["status"] == "PASS", reports[node]["versions"]
    reduce = reports["node1"]["all-reduce"]
    assert reduce["status"] == "PASS" and "over 2 hosts, 2 ranks" in reduce["detail"], reduce


def test_two_nodes_started_by_hand_without_ssh_train_as_one_machine_does(
    shards: Path, reference: dict[int, float], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two hosts (network namespaces) each run `pipeline pretrain --from-env` with NNODES, NODE_RANK and
    MASTER_ADDR, as a Kubernetes JobSet or torchrun's multi-node launch sets them; no ssh is reached (an `ssh`
    first on PATH would record its call)."""
    with netns.hosts(tmp_path_factory.mktemp("fromenv")) as h:
        work = h["work"]
        trap = work / "trap"
        trap.mkdir()
        (trap / "ssh").write_text(f'#!/bin/sh\necho "$@" >> {work}/ssh_called\nexit 255\n')
        (trap / "ssh").chmod(0o755)
        run_dir = work / "run"
        cfg = launch.write_config(work / "c.yaml", run_dir=run_dir, shards=shards, **KW)  # type: ignore[arg-type]
        port = str(launch.free_port())
        base = launch.env()
        env = {**base, "PATH": f"{trap}:{base['PATH']}", "GLOO_SOCKET_IFNAME": h["iface"], "NNODES": "2"}
        env |= {"MASTER_ADDR": f"{h['subnet']}.1", "MASTER_PORT": port}
        procs = []
        for rank, ns in enumerate(h["ns"]):
            cmd = [
                "ip",
                "netns",
                "exec",
                ns,
                "timeout",
                "600",
                PIPELINE,
                "pretrain",
                "--from-env",
                "--config",
                str(cfg),
            ]
            log = open(work / f"node{rank}.log", "w")  # noqa: SIM115 - closed with the process
            procs.append(
                (
                    subprocess.Popen(
                        cmd, env={**env, "NODE_RANK": str(rank)}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
                    ),
                    log,
                )
            )
        for proc, log in procs:
            proc.wait(timeout=700)
            log.close()
        said = [(work / f"node{r}.log").read_text() for r in range(2)]
        assert [p.returncode for p, _ in procs] == [0, 0], said[0][-3000:] + said[1][-3000:]
        assert not (work / "ssh_called").exists()
        assert "node 1 of 2 (node0, node1), 1 rank(s) per node" in said[1]
        _same(run_dir, reference)
        assert (run_dir / "logs" / "launch-node1.log").is_file()
