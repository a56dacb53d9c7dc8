"""pipeline.plan.hostfile: the reference hostfiles carry their clusters."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import PipelineError
from pipeline.plan.hostfile import expand_hostlist


def test_reference_hostfiles_carry_their_clusters() -> None:
    r = CliRunner().invoke(main, ["plan", "--model", "7b", "--hostfile", "hostfiles/4node4gpu"])
    assert "cluster facts from hostfiles/4node4gpu: gpu=4090d cpu_mem=120GB cpu_cores=10" in r.output
    assert "defaults for network" in r.output and "120 GB RAM and 10 cores/node" in r.output
    assert "a safe save keeps 1 checkpoint(s) while writing the next" in r.output  # 2 x 20 GB > the 40 GB disk
    assert "chosen: ZeRO-2" in r.output and "-- BUT ITS CHECKPOINTS DO NOT FIT THE DISK (below)" in r.output
    r = CliRunner().invoke(main, ["plan", "--model", "13b", "--hostfile", "hostfiles/4node4gpu", "--json"])
    d = json.loads(r.output)["best"]
    assert (
        d is None or any("checkpoint disk" in w for w in d["warnings"]) or any("checkpoint" in w for w in d["why_not"])
    )
    r = CliRunner().invoke(main, ["plan", "--model", "70b", "--hostfile", "hostfiles/4node4gpu"])
    assert r.exit_code == 3 and "host RAM" in r.output and "(80% limit: 96 GB)" in r.output
    r = CliRunner().invoke(main, ["plan", "--model", "70b", "--hostfile", "hostfiles/4node4gpu", "--cpu-mem", "512GB"])
    assert "cpu_mem=120GB" not in r.output.splitlines()[0] and "512 GB RAM and 10 cores/node" in r.output  # flag wins
    # The 8 x 1 cluster's answer is the same with its facts as with the flags it had before.
    a = CliRunner().invoke(main, ["plan", "--model", "70b", "--hostfile", "hostfiles/8node", "--json"]).output
    flags = ["--gpu", "4090d", "--cpu-mem", "512GB", "--cpu-cores", "128", "--cpu-mem-bw", "300GB/s"]
    b = CliRunner().invoke(main, ["plan", "--model", "70b", "--nodes", "8", "--gpus-per-node", "1", *flags, "--json"])
    assert json.loads(a)["best"]["label"] == json.loads(b.output)["best"]["label"]
    assert json.loads(a)["best"]["label"].startswith("ZeRO-3 + cpu offload (opt, params) + ckpt (offloaded), micro")


def test_slurm_host_lists_expand_in_order_with_their_padding() -> None:
    assert expand_hostlist("node[01-03,7],gpu-a[1-2]-x") == [
        "node01",
        "node02",
        "node03",
        "node7",
        "gpu-a1-x",
        "gpu-a2-x",
    ]
    assert expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    assert expand_hostlist("solo") == ["solo"]
    for bad, said in (("node[1-", "unclosed"), ("node[a-b]", "not a list of numbers"), ("", "names no node")):
        with pytest.raises(PipelineError, match=said):
            expand_hostlist(bad)
