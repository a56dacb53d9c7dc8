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


def test_kernel_packages_are_priced_as_the_facts_say_and_the_probe_records_them(tmp_path) -> None:
    """Liger's modules are priced only where the nodes are known to have liger-kernel: `--packages`, the hostfile's
    `packages=`, or what `pipeline probe` found on a node (a flag wins); unknown, transformers' modules, and the
    plan says how to tell it. A name it does not price is refused naming the line or the flag."""
    from pipeline.plan.probe import installed_packages, probe_node

    seven = ["plan", "--model", "7b", "--seq-len", "32768", "--json"]

    def kernels(*args: str) -> str:
        r = CliRunner().invoke(main, [*seven, *args])
        assert r.exit_code == 0, r.output
        plan = json.loads(r.output[r.output.index("{") :])  # after the note on the RoPE's length
        return " ".join(a["value"] for a in plan["best"]["assumed"] if a["figure"] == "speed switches")

    assert "liger" not in kernels()
    assert "liger" in kernels("--packages", "liger-kernel")
    hf = tmp_path / "hosts"
    hf.write_text("# cluster: gpu=4090d packages=liger-kernel,flash-attn\na slots=1\n")
    assert "liger" in kernels("--hostfile", str(hf))
    assert "liger" not in kernels("--hostfile", str(hf), "--packages", "none")
    text = CliRunner().invoke(main, ["plan", "--model", "7b", "--seq-len", "32768"]).output
    assert "kernels priced: transformers' modules; no kernel package known installed on the nodes" in text
    hf.write_text("# cluster: gpu=4090d packages=liger\na slots=1\n")
    r = CliRunner().invoke(main, [*seven, "--hostfile", str(hf)])
    assert r.exit_code == 2 and "hosts:1: packages= liger: liger is not a kernel package" in r.output
    r = CliRunner().invoke(main, [*seven, "--packages", "apex"])
    assert r.exit_code == 2 and "--packages apex: apex is not a kernel package" in r.output
    # a probe records the node's packages, and the plan takes them from it
    doc = probe_node(quick=True)
    assert doc["packages"] == installed_packages()
    probe = tmp_path / "node.probe.json"
    probe.write_text(json.dumps(doc | {"packages": ["liger-kernel"]}))
    hf.write_text("# cluster: gpu=4090d\na slots=1\n")
    r = CliRunner().invoke(main, [*seven[:-1], "--hostfile", str(hf), "--probe", str(probe)])
    # (which modules the chosen configuration runs depends on the rates this busy or idle machine measured)
    assert (
        r.exit_code == 0 and "packages=liger-kernel" in r.output and "packages on the nodes: liger-kernel" in r.output
    )
