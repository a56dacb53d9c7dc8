"""pipeline.plan.facts: what the planner assumed of the cluster is said, a hostfile without facts plans with
named defaults."""

from __future__ import annotations

import json

from click.testing import CliRunner

from pipeline.cli import main


def test_what_the_planner_assumed_of_the_cluster_is_said() -> None:
    r = CliRunner().invoke(main, ["plan", "--model", "7b", "--cpu-mem", "256GB", "--tokens", "100bn"])
    assert (
        r.exit_code == 0 and "assumed, not given: gpu=4090d cpu_cores=32 cpu_mem_bw=80GB/s network=100Gbps" in r.output
    )
    assert "time to 100B tokens" in r.output
    d = json.loads(CliRunner().invoke(main, ["plan", "--model", "7b", "--json"]).output)
    assert d["cluster_facts"].startswith("assumed, not given: gpu=4090d cpu_mem=512GB")
    r = CliRunner().invoke(main, ["plan", "--model", "7b", "--hostfile", "hostfiles/8node"])
    assert "assumed, not given" not in r.output and "cluster facts from hostfiles/8node" in r.output


def test_a_hostfile_without_facts_plans_with_named_defaults(tmp_path) -> None:
    hf = tmp_path / "hosts"
    hf.write_text("a slots=2\nb slots=2\n")
    r = CliRunner().invoke(main, ["plan", "--model", "1b", "--hostfile", str(hf)])
    assert r.exit_code == 0 and "has no '# cluster:' line" in r.output and "defaults for cpu_cores, cpu_mem" in r.output
    hf.write_text("# cluster: gpu=4090d ram=1TB\na slots=2\n")
    r = CliRunner().invoke(main, ["plan", "--model", "1b", "--hostfile", str(hf)])
    assert r.exit_code == 2 and "hosts:1: 'ram=1TB'" in r.output
