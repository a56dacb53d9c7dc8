"""`pipeline pretrain --hostfile H --min-nodes N` (pipeline.launch.shrink): which hosts a launch runs on when some
stop answering ssh, with which batch, and when the run stops instead (too few hosts, a plan that no longer fits, a
batch the ranks cannot split). Real configs, real shards, the real planner; the hosts answer through an ssh
stand-in on PATH that fails for the hosts named in a file (what a lost node looks like to ssh)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.launch.shrink import SURVIVORS, Survivors, micro_batch_for
from pipeline.launch.supervise import run_with_restarts
from tests.multiproc import launch

ROOT = Path(__file__).resolve().parents[3]
CLUSTER = "# cluster: gpu=4090d cpu_mem=512GB cpu_cores=128 cpu_mem_bw=300GB/s network=100Gbps"


def hostfile(path: Path, hosts: list[str], slots: int = 1, cluster: str = CLUSTER) -> str:
    path.write_text(f"# the test's cluster\n{cluster}\n" + "".join(f"{h} slots={slots}\n" for h in hosts))
    return str(path)


def survivors(
    tmp_path: Path, cfg: Path, hosts: str, *, min_nodes: int, global_batch: int, micro: int, sets: tuple = ()
) -> Survivors:
    cmd = ["deepspeed", "--hostfile", hosts, "pretrain.py", "--config", str(cfg)]
    cmd += [a for s in sets for a in ("--set", s)]
    return Survivors(
        cmd=cmd,
        config=str(cfg),
        sets=list(sets),
        hostfile=hosts,
        min_nodes=min_nodes,
        run_dir=tmp_path / "run",
        global_batch=global_batch,
        micro_batch=micro,
        sequence_parallel=1,
        seq_len=64,
        batch_in_tokens=False,
    )


def sets_of(cmd: list[str]) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]


@pytest.mark.parametrize(
    "global_batch, micro, replicas, expected",
    [(8, 2, 4, 2), (8, 2, 3, None), (12, 4, 2, 3), (12, 4, 3, 4), (6, 1, 2, 1), (992, 4, 7, None), (96, 4, 7, None)],
)
def test_the_micro_batch_is_the_largest_that_splits_the_global_batch(
    global_batch: int, micro: int, replicas: int, expected: int | None
) -> None:
    assert micro_batch_for(global_batch, micro, replicas) == expected


def test_a_lost_host_gives_a_launch_on_the_others_with_the_same_global_batch_and_takes_it_back(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=tmp_path / "run", shards=shards, ds_config="zero2.json", micro=4, global_batch=12
    )
    hosts = hostfile(tmp_path / "hosts", ["node0", "node1", "node2"])
    s = survivors(tmp_path, cfg, hosts, min_nodes=2, global_batch=12, micro=4, sets=("train.max_steps=9",))
    assert s.command([]) == s.cmd  # all answer: the launch as built
    cmd = s.command([("node1", "ssh: connect to host node1 port 22: No route to host")])
    said = capsys.readouterr().err
    written = tmp_path / "run" / "logs" / SURVIVORS
    assert cmd[cmd.index("--hostfile") + 1] == str(written)
    # the hostfile's comments (its cluster line among them) and the hosts that answer, in its order
    assert written.read_text() == f"# the test's cluster\n{CLUSTER}\nnode0 slots=1\nnode2 slots=1\n"
    # 12 sequences over 2 ranks: micro 4 does not split it (4 x 2 = 8), micro 3 does, with 2 micro-steps each
    assert sets_of(cmd) == ["train.max_steps=9", "batch.micro_batch_size=3"]
    assert "do not answer ssh: node1 (ssh: connect to host node1 port 22: No route to host)" in said
    assert "Continuing on the 2 that do (node0, node2; 2 ranks, micro-batch 3 instead of 4, the same 12" in said
    # the lost host named in the run's records
    event = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert event["event"] == "hosts" and event["hosts"] == ["node0", "node2"] and "node1" in event["lost"]
    assert event["world_size"] == 2 and '"event": "hosts"' in (tmp_path / "run/logs/launch.log").read_text()
    # the same hosts lost again: the same launch, said once
    assert s.command([("node1", "still gone")]) == cmd and "Continuing" not in capsys.readouterr().err
    # node1 answers again: the next launch takes it back, with the run's own batch
    assert s.command([]) == s.cmd
    assert f"every host of {hosts} answers again: launching on all 3" in capsys.readouterr().err
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["hosts"] == ["node0", "node1", "node2"] and last["lost"] == {}


@pytest.mark.parametrize("in_tokens", [False, True])
def test_a_global_batch_no_micro_batch_splits_becomes_the_nearest_that_does_and_is_said(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], in_tokens: bool
) -> None:
    """8 ranks of 4 sequences, 96 per step, lose one host: 96 is not a multiple of 7 at any micro-batch; the
    nearest global batch that 7 ranks of 4 split is 84 (98 is farther), given as the config gives it."""
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=tmp_path / "run", shards=shards, ds_config="zero2.json", micro=4, global_batch=96
    )
    names = [f"node{i}" for i in range(8)]
    s = survivors(tmp_path, cfg, hostfile(tmp_path / "hosts", names), min_nodes=4, global_batch=96, micro=4)
    s.batch_in_tokens = in_tokens
    if in_tokens:
        text = cfg.read_text().replace("global_batch_size: 96", "global_batch_tokens: 6144")
        cfg.write_text(text)
    cmd = s.command([("node7", "gone")])
    expected = "batch.global_batch_tokens=5376" if in_tokens else "batch.global_batch_size=84"
    assert sets_of(cmd) == [expected]
    assert "84 sequences per step instead of 96: the nearest that 7 data-parallel ranks split" in (
        capsys.readouterr().err
    )


def test_fewer_hosts_than_min_nodes_stop_the_run_naming_them(shards: Path, tmp_path: Path) -> None:
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=tmp_path / "run", shards=shards, ds_config="zero2.json")
    hosts = hostfile(tmp_path / "hosts", ["node0", "node1", "node2", "node3"])
    s = survivors(tmp_path, cfg, hosts, min_nodes=3, global_batch=8, micro=2)
    with pytest.raises(PipelineError) as e:
        s.command([("node1", "no route"), ("node3", "timed out")])
    assert "2 of 4 hosts answer ssh (not node1 (no route); node3 (timed out)), fewer than --min-nodes 3" in str(e.value)
    assert not (tmp_path / "run" / "logs" / SURVIVORS).exists()


@pytest.mark.parametrize(
    "config, hosts_file, lost, fits",
    [
        # 70B on the seed cluster fits 8 nodes down to 4 (the ZeRO-3 shard per card grows 8/k): 5 lost do not fit
        ("70b_8node.yaml", "8node", 5, False),
        ("70b_8node.yaml", "8node", 1, True),
        # 7B on 4 rented 4-card nodes: two lost take half the host RAM its offloaded optimizer needs
        ("7b_8node.yaml", "4node4gpu", 2, False),
        ("7b_8node.yaml", "4node4gpu", 1, True),
    ],
)
def test_the_run_goes_on_only_where_the_plan_for_the_hosts_that_answer_fits(
    shards: Path, tmp_path: Path, config: str, hosts_file: str, lost: int, fits: bool
) -> None:
    text = (ROOT / "hostfiles" / hosts_file).read_text()
    names = [line.split()[0] for line in text.splitlines() if line and not line.startswith("#")]
    path = tmp_path / hosts_file
    path.write_text(text)
    slots = int(text.split("slots=")[-1].split()[0])
    left = (len(names) - lost) * slots
    global_batch = 2 * 16 * 3 * 5 * 7  # every world size here (16, 12, 8, 7, 4 or 3 ranks) splits it at micro 2
    sets = (f"data.path={shards}", f"run_dir={tmp_path / 'run'}", f"batch.global_batch_size={global_batch}")
    sets += ("batch.micro_batch_size=2",)
    s = survivors(tmp_path, ROOT / "configs" / config, str(path), min_nodes=1, global_batch=global_batch, micro=2)
    s.sets, s.cmd = list(sets), [*s.cmd, *(a for x in sets for a in ("--set", x))]
    gone = [(h, "gone") for h in names[len(names) - lost :]]
    if fits:
        assert sets_of(s.command(gone))[: len(sets)] == list(sets)
        return
    with pytest.raises(PipelineError) as e:
        s.command(gone)
    assert f"the plan for the {left} ranks of the hosts that answer does not fit (" in str(e.value)
    assert "where the whole hostfile's does" in str(e.value) and "pipeline plan --config" in str(e.value)


def test_the_supervisor_relaunches_on_the_hosts_that_answer(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """run_with_restarts with --min-nodes: the first launch fails and node2 stops answering: the relaunch runs on
    node0 and node1; before the first launch every host answered, so it ran on all three."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    lost = tmp_path / "lost"
    lost.write_text("")
    (bin_dir / "ssh").write_text(
        '#!/bin/sh\nfor a in "$@"; do h=$last; last=$a; done\n'
        f'grep -qx "$h" {lost} && {{ echo "ssh: connect to host $h port 22: No route to host" >&2; exit 255; }}\n'
        "exit 0\n"
    )
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=tmp_path / "run", shards=shards, ds_config="zero2.json")
    hosts = hostfile(tmp_path / "hosts", ["node0", "node1", "node2"])
    launches = tmp_path / "launches"
    # the "launcher": records its hostfile; the first launch loses node2 and fails
    script = (
        "import sys, pathlib; p = pathlib.Path(sys.argv[1]); h = sys.argv[sys.argv.index('--hostfile') + 1]; "
        "n = len(p.read_text().splitlines()) if p.exists() else 0; p.open('a').write(h + '\\n'); "
        f"n == 0 and pathlib.Path({str(lost)!r}).write_text('node2\\n'); sys.exit(1 if n == 0 else 0)"
    )
    cmd = [sys.executable, "-c", script, str(launches), "--hostfile", hosts, "--config", str(cfg)]
    s = survivors(tmp_path, cfg, hosts, min_nodes=2, global_batch=8, micro=2)
    s.cmd = cmd
    code = run_with_restarts(cmd, 1, tmp_path / "run", ["node0", "node1", "node2"], s)
    said = capsys.readouterr().err
    assert code == 0, said
    assert launches.read_text().splitlines() == [hosts, str(tmp_path / "run" / "logs" / SURVIVORS)]
    assert "do not answer ssh: node2 (ssh: connect to host node2 port 22: No route to host)" in said
    assert "restart 1 of 1" in said
    # with too few answering before the first launch, nothing starts: one error naming them
    lost.write_text("node1\nnode2\n")
    launches.unlink()
    s = survivors(tmp_path, cfg, hosts, min_nodes=2, global_batch=8, micro=2)
    with pytest.raises(PipelineError, match="1 of 3 hosts answer ssh"):
        run_with_restarts(cmd, 1, tmp_path / "run", ["node0", "node1", "node2"], s)
    assert not launches.exists()


def test_min_nodes_without_restarts_is_refused_and_what_sharing_a_sample_allows_is_said(
    shards: Path, tmp_path: Path
) -> None:
    """--min-nodes acts on a relaunch: without --max-restarts the first lost host would end the run, so the pair is
    refused in one line; with sequence parallelism a relaunch goes on only with host counts whose ranks the groups
    divide, and the launch says which before anything runs."""
    from click.testing import CliRunner

    from pipeline.cli import main

    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=tmp_path / "run", shards=shards, ds_config="zero2.json", micro=1, global_batch=8
    )
    hosts = hostfile(tmp_path / "hosts", ["node0", "node1", "node2", "node3"])
    args = ["pretrain", "--config", str(cfg), "--hostfile", hosts, "--dry-run", "--min-nodes", "2"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "--max-restarts is 0: the first lost host would end the run" in r.output, r.output
    r = CliRunner().invoke(main, [*args, "--max-restarts", "3", "--set", "train.sequence_parallel=2"])
    assert r.exit_code == 0, r.output
    assert "with train.sequence_parallel 2 a relaunch goes on with 2, 4 of the 4 hosts" in r.output
    r = CliRunner().invoke(main, [*args, "--max-restarts", "3"])
    assert r.exit_code == 0 and "relaunch goes on with" not in r.output, r.output
