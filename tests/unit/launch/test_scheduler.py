"""pipeline.launch.scheduler: the world a scheduler's variables describe (Slurm under srun, torchrun's, a JobSet's,
SkyPilot's), each inconsistency refused in one line naming the variable and the fix; the first
node's word to the others in the run folder; the Slurm job script `pipeline pretrain --sbatch` writes."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.launch.scheduler import Handshake, Scheduled, from_environment, job_script, node_command


def _step(**more: str) -> dict[str, str]:
    """What srun sets in each task of `srun --ntasks-per-node=1` on two nodes (read off Slurm 22.05)."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NODEID": "1",
        "SLURM_GPUS_ON_NODE": "4",
    }
    return env | more


def test_a_slurm_step_gives_the_nodes_this_nodes_rank_its_gpus_and_a_port_of_the_job() -> None:
    world = from_environment(_step(), None, 4, resolve=lambda node: f"10.0.0.{node[-1]}")
    assert world.hosts == ("gpu07", "gpu08") and world.node_rank == 1 and world.per_node == 4
    assert world.master_addr == "10.0.0.7" and world.master_port == 20000 + 4242
    assert world.world_size == 8 and world.launch_id == "slurm-4242-0-0"
    requeued = from_environment(_step(SLURM_RESTART_COUNT="1", MASTER_PORT="31000"), None, 4, resolve=str)
    assert requeued.launch_id != world.launch_id and requeued.master_port == 31000 and "requeued 1x" in requeued.source
    cmd = node_command(world, Path("pretrain.py"), ["--config", "c.yaml"], "python", ["--bind_cores_to_rank"])
    assert (
        "--node_rank=1" in cmd and "--master_addr=10.0.0.7" in cmd and cmd[-3:] == ["pretrain.py", "--config", "c.yaml"]
    )


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({**_step(), "SLURM_STEP_ID": None}, "outside `srun`: only this node would start"),
        (_step(SLURM_STEP_NUM_TASKS="8"), "8 tasks on 2 node(s): run one task per node"),
        (_step(SLURM_NODEID="x"), "SLURM_NODEID='x' is not a whole number"),
        ({"NNODES": "2", "MASTER_ADDR": "a"}, "--from-env: NODE_RANK not set"),
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "a"}, "node rank 2 is not one of the 2 nodes"),
        ({"SKYPILOT_NODE_RANK": "0"}, "without SKYPILOT_NODE_IPS"),
    ],
)
def test_an_environment_that_does_not_describe_one_launch_is_refused_naming_the_variable(
    env: dict[str, str | None], said: str
) -> None:
    with pytest.raises(PipelineError, match=said.replace("(", r"\(").replace(")", r"\)")):
        from_environment({k: v for k, v in env.items() if v is not None}, None, 0, resolve=str)


def test_gpus_per_node_unlike_the_allocation_are_refused_naming_both_fixes() -> None:
    with pytest.raises(PipelineError, match=r"--num-gpus 8, but Slurm gave node gpu08 4 GPU\(s\).*--gpus-per-node=8"):
        from_environment(_step(), 8, 4, resolve=str)


def test_torchrun_jobset_and_skypilot_variables_give_the_same_world() -> None:
    torchrun = from_environment(
        {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29400"}, 2, 0
    )
    jobset = from_environment(
        {"NNODES": "2", "JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29400"}, 2, 0
    )
    sky = from_environment(
        {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.1.1.1\n10.1.1.2\n", "MASTER_PORT": "29400"}, 2, 0
    )
    for world in (torchrun, jobset, sky):
        assert (world.nnodes, world.node_rank, world.master_addr, world.master_port, world.world_size) == (
            2,
            1,
            "10.1.1.1",
            29400,
            4,
        )
    # Variables set by hand inside a Slurm job win over the job's own.
    mixed = from_environment({**_step(), "NNODES": "3", "NODE_RANK": "2", "MASTER_ADDR": "h"}, None, 0)
    assert mixed.nnodes == 3 and mixed.node_rank == 2


@pytest.mark.parametrize(
    ("scheduled", "hostfile", "restarts", "min_nodes", "said"),
    [
        (Scheduled(from_env=True, sbatch="j.sh"), None, 0, None, "give one of them"),
        (Scheduled(from_env=True), "hostfiles/8node", 0, None, "need none: drop it"),
        (Scheduled(from_env=True), None, 3, None, "the relaunch is the scheduler's"),
        (Scheduled(sbatch="j.sh", nodes=2), None, 3, None, "drop --max-restarts and use the job script's --requeue"),
        (Scheduled(from_env=True), None, 0, 2, "--min-nodes with --from-env needs --nodes N"),
        (Scheduled(sbatch="j.sh"), None, 0, None, "--sbatch needs --nodes N"),
        (Scheduled(sbatch="j.sh", nodes=2), None, 0, 3, "--min-nodes 3 is more than --nodes 2"),
        (Scheduled(requeue=True, time_limit="1:00"), None, 0, None, "--time, --requeue only go(es) with --sbatch"),
        (Scheduled(nodes=2), None, 0, None, "--nodes goes with --sbatch or --from-env"),
    ],
)
def test_scheduler_options_that_do_not_go_together_are_one_line(
    scheduled: Scheduled, hostfile: str | None, restarts: int, min_nodes: int | None, said: str
) -> None:
    assert said in (scheduled.problem(hostfile, restarts, min_nodes) or "")


def test_plain_and_scheduler_options_that_go_together_pass() -> None:
    assert Scheduled().problem("hostfiles/8node", 3, 7) is None
    assert Scheduled(sbatch="j.sh", nodes=8, requeue=True, time_limit="2-00:00:00").problem(None, 0, 6) is None
    assert Scheduled(from_env=True, nodes=2).problem(None, 0, None) is None
    assert Scheduled(from_env=True, nodes=8).problem(None, 0, 6) is None


def test_the_first_nodes_word_reaches_the_others_and_a_refusal_or_silence_is_one_line(tmp_path: Path) -> None:
    world = from_environment({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "h", "PIPELINE_LAUNCH_ID": "a"}, 1, 0)
    run_dir = tmp_path / "run"
    first, other = Handshake(run_dir, world), Handshake(run_dir, world)
    said: list[str] = []
    threading.Timer(0.3, first.say, args=(True,)).start()
    t0 = time.monotonic()
    other.wait(said.append, timeout=30)
    assert time.monotonic() - t0 < 10 and (run_dir / ".launch.json").is_file()
    first.say(False, "the data's fingerprint changed")
    with pytest.raises(PipelineError, match="node 0 .* refused the launch: the data's fingerprint changed"):
        other.wait(said.append, timeout=30)
    # The word of another launch (the run's previous job) is not this one's: silence, then the shared folder named.
    later = from_environment({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "h", "PIPELINE_LAUNCH_ID": "b"}, 1, 0)
    with pytest.raises(PipelineError, match="must be one folder shared by every node"):
        Handshake(run_dir, later).wait(said.append, timeout=1)
    # A refusal before the run folder exists writes nothing: no folder made only to say no.
    Handshake(tmp_path / "never", world).say(False, "bad config")
    assert not (tmp_path / "never").exists()


def test_the_job_script_asks_for_the_nodes_and_runs_one_from_env_task_per_node(tmp_path: Path) -> None:
    text = job_script(
        config="configs/70b_8node.yaml",
        sets=["train.max_steps=100"],
        nodes=8,
        min_nodes=6,
        gpus_per_node=1,
        time_limit="2-00:00:00",
        partition="gpu",
        requeue=True,
        grace_s=300,
        workdir=Path("/work/my project"),
        python_bin=Path("/venv/bin"),
        output=Path("/work/job-%j.out"),
    )
    for line in (
        "#SBATCH --nodes=6-8",
        "#SBATCH --gpus-per-node=1",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@300",
        "cd '/work/my project'",
    ):
        assert line in text.splitlines(), line
    assert (
        "srun --ntasks-per-node=1 --kill-on-bad-exit=0 /venv/bin/pipeline pretrain --from-env --config "
        "configs/70b_8node.yaml --set train.max_steps=100 --nodes 8 --min-nodes 6 --num-gpus 1 &" in text
    )
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "#SBATCH --ntasks-per-node" not in text  # with it Slurm starts a 6-8 node job on 6
    script = tmp_path / "job.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    plain = job_script(
        config="c.yaml",
        sets=[],
        nodes=2,
        min_nodes=None,
        gpus_per_node=0,
        time_limit=None,
        partition=None,
        requeue=False,
        grace_s=300,
        workdir=tmp_path,
        python_bin=Path("/venv/bin"),
        output=tmp_path / "o",
    )
    assert "#SBATCH --nodes=2" in plain and "--gpus-per-node" not in plain and "scontrol requeue" not in plain
    assert "#SBATCH --no-requeue" in plain


def test_an_allocation_unlike_the_run_is_one_line_before_anything_starts(shards: Path, tmp_path: Path) -> None:
    """`pipeline pretrain --from-env` on a job with fewer nodes than the run asks for, and `--sbatch` for a node
    count the config's batch cannot be split over: exit 2, one line naming the fix, no run folder, no script."""
    from click.testing import CliRunner

    from pipeline.cli import main
    from tests.multiproc import launch

    run_dir = tmp_path / "run"
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", micro=1)
    env = {"NNODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "DS_ACCELERATOR": "cpu"}
    out = CliRunner().invoke(main, ["pretrain", "--from-env", "--nodes", "2", "--config", str(cfg)], env=env)
    lines = [x for x in out.output.splitlines() if x.startswith("error:")]
    assert out.exit_code == 2 and len(lines) == 1, out.output
    assert "NNODES/NODE_RANK/MASTER_ADDR has 1 node(s) (node0), and the run asks --nodes 2" in lines[0]
    assert "ask the scheduler for 2" in lines[0] and not run_dir.exists()
    # 8 sequences per step on 3 nodes: no micro-batch splits them
    script = tmp_path / "job.sh"
    out = CliRunner().invoke(main, ["pretrain", "--config", str(cfg), "--sbatch", str(script), "--nodes", "3"])
    assert out.exit_code == 2 and "on 3 node(s) x 1 rank(s):" in out.output and not script.exists(), out.output
    out = CliRunner().invoke(
        main, ["pretrain", "--config", str(cfg), "--sbatch", str(script), "--nodes", "2", "--time", "1:00:00"]
    )
    assert out.exit_code == 0 and f"submit it with: sbatch {script}" in out.output, out.output
    assert "#SBATCH --time=1:00:00" in script.read_text() and "no --num-gpus: the job asks for no GPUs" in out.output


def _doc_block(after: str) -> dict:
    """The first ```yaml block after the line starting with `after` in docs/multinode.md, parsed."""
    import yaml

    text = (Path(__file__).resolve().parents[3] / "docs" / "multinode.md").read_text()
    block = text[text.index(after) :].split("```yaml\n", 1)[1].split("```", 1)[0]
    return yaml.safe_load(block)


def test_the_kubernetes_and_skypilot_examples_give_each_node_its_place() -> None:
    """docs/multinode.md's JobSet and SkyPilot task, parsed: what each sets on its second node is read by
    `--from-env` as node 1 of the nodes asked for, the rendezvous at the first pod's DNS name."""
    jobset = _doc_block("**Kubernetes**")
    assert jobset["kind"] == "JobSet" and jobset["spec"]["network"]["enableDNSHostnames"] is True
    rjob = jobset["spec"]["replicatedJobs"][0]
    job = rjob["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    container = job["template"]["spec"]["containers"][0]
    assert container["command"][:3] == ["pipeline", "pretrain", "--from-env"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    name = jobset["metadata"]["name"]
    assert env["MASTER_ADDR"] == f"{name}-{rjob['name']}-0-0.{name}"  # JobSet's pod hostname and subdomain
    world = from_environment(env | {"JOB_COMPLETION_INDEX": "1"}, None, 1)
    assert (world.nnodes, world.node_rank, world.per_node) == (job["parallelism"], 1, 1)
    sky = _doc_block("**SkyPilot**")
    assert "--from-env" in sky["run"]
    ips = "\n".join(f"10.0.0.{i}" for i in range(sky["num_nodes"]))
    world = from_environment(
        {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": ips, "SKYPILOT_NUM_GPUS_PER_NODE": "1"}, None, 0
    )
    assert (world.nnodes, world.node_rank, world.master_addr, world.per_node) == (sky["num_nodes"], 1, "10.0.0.0", 1)
