"""pipeline/plan/probe.py and what `pipeline plan` does with a probe: the node facts it measured replace the
assumed ones (a flag given still wins), the plan says which figures were measured and gives them a narrower
range; a probe of another GPU leaves the card's rates alone; a damaged probe is refused naming its file."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import PipelineError
from pipeline.model import PRESETS
from pipeline.plan.cluster import Layout
from pipeline.plan.estimate import estimate
from pipeline.plan.facts import CLUSTER_DEFAULTS, cluster_from_flags
from pipeline.plan.gpus import GPUS
from pipeline.plan.timing import ADAM_BYTES, ASSUMED_SPREAD, MEASURED_SPREAD, RANGE

OFFLOAD = Layout(3, "cpu", "cpu", True, 1, 1, 1e8, 1e8, 3e8, 1e8)
NO_FLAGS: dict[str, str | None] = {k: None for k in CLUSTER_DEFAULTS}


def probe_doc(gpu: str | None = "NVIDIA GeForce RTX 4090 D") -> dict[str, Any]:
    """A probe as `pipeline probe` writes it (pipeline.plan.probe.probe_node), of a 32-core 4090D node."""
    return {
        "version": 1,
        "host": "node1",
        "when": "2026-12-05 08:00:00 +0000",
        "quick": False,
        "cpu_cores": 32,
        "torch_threads": 32,
        "gpu": gpu,
        "memory": {"bytes": 2**30, "threads": 32.0, "bytes_per_s": 61e9},
        "pinned": {"bytes": 2**30, "h2d_bytes_per_s": 24e9, "d2h_bytes_per_s": 21e9} if gpu else None,
        "cpu_adam": {"params": 2**26, "threads": 32.0, "params_per_s": 1.5e9},
        "gemm": {"attention_proj_tflops": 120.0, "mlp_up_tflops": 132.0} if gpu else None,
    }


def hostfile(tmp_path: Path, facts: str = "gpu=4090d cpu_mem=512GB cpu_cores=32", host: str = "node1") -> str:
    path = tmp_path / "cluster"
    path.write_text(f"{host} slots=1\n# cluster: {facts}\n")
    return str(path)


def test_a_probe_beside_the_hostfile_replaces_the_facts_it_measured(tmp_path: Path) -> None:
    hf = hostfile(tmp_path)
    before, _ = cluster_from_flags(hf, 1, 1, NO_FLAGS)
    Path(hf + ".probe.json").write_text(json.dumps(probe_doc()))
    c, source = cluster_from_flags(hf, 1, 1, NO_FLAGS)
    assert c.cpu_mem_bw_gbs == pytest.approx(61) and c.cpu_adam_params_per_s == pytest.approx(1.5e9)
    assert c.gpu.pcie_gbs == pytest.approx(21)  # the slower direction
    assert c.gpu.gemm_fraction == pytest.approx(132 / GPUS["4090d"].bf16_tflops)
    assert c.measured == {"cpu_adam", "cpu_mem_bw", "pcie", "gemm"} and not before.measured
    assert "measured by pipeline probe on node1 at 2026-12-05" in source and hf + ".probe.json" in source
    assert c.cpu_mem_bytes == before.cpu_mem_bytes and c.cpu_cores == before.cpu_cores  # not measured: unchanged
    r = CliRunner().invoke(main, ["plan", "--hostfile", hf, "--model", "7b", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["cluster"]["measured"] == ["cpu_adam", "cpu_mem_bw", "gemm", "pcie"]


def test_a_flag_wins_over_the_probe_and_a_probe_can_be_named(tmp_path: Path) -> None:
    hf = hostfile(tmp_path)
    named = tmp_path / "elsewhere.json"
    named.write_text(json.dumps(probe_doc()))
    c, _ = cluster_from_flags(hf, 1, 1, NO_FLAGS | {"cpu_mem_bw": "100GB/s", "probe": str(named)})
    assert c.cpu_mem_bw_gbs == pytest.approx(100) and "cpu_mem_bw" not in c.measured
    assert c.cpu_adam_params_per_s == pytest.approx(1.5e9)
    # the hostfile's probe=FILE, relative to the hostfile's folder
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "node.json").write_text(json.dumps(probe_doc()))
    c, source = cluster_from_flags(hostfile(tmp_path / "sub", "gpu=4090d probe=node.json"), 1, 1, NO_FLAGS)
    assert "cpu_adam" in c.measured and str(tmp_path / "sub" / "node.json") in source


def test_a_probe_of_another_gpu_gives_only_the_host(tmp_path: Path) -> None:
    hf = hostfile(tmp_path)
    Path(hf + ".probe.json").write_text(json.dumps(probe_doc("NVIDIA H200")))
    c, source = cluster_from_flags(hf, 1, 1, NO_FLAGS)
    assert c.gpu == GPUS["4090d"] and c.measured == {"cpu_adam", "cpu_mem_bw"}
    assert "its GPU (NVIDIA H200) is not this plan's RTX 4090D" in source


def test_measured_cpu_adam_sets_the_optimizer_time_in_a_narrower_range(tmp_path: Path) -> None:
    """The measured fp32 rate, the 16-bit kinds by the bytes they touch, and the range's factors narrowed to
    RANGE ** MEASURED_SPREAD for what was measured; the point estimate is the measured rate itself."""
    hf = hostfile(tmp_path)
    Path(hf + ".probe.json").write_text(json.dumps(probe_doc()))
    c, _ = cluster_from_flags(hf, 1, 1, NO_FLAGS)
    shape = PRESETS["7b"]
    e = estimate(shape, 4096, c, OFFLOAD)
    assert e.time["optimizer"] == pytest.approx(shape.num_params() / 1.5e9)
    states = estimate(shape, 4096, c, replace(OFFLOAD, bf16_master=True, bf16_optimizer_states=True))
    assert states.time["optimizer"] == pytest.approx(shape.num_params() / (1.5e9 * 40 / ADAM_BYTES["bf16_states"]))
    assumed = {figure: source for figure, _, source in e.assumed}
    assert "measured on a node by `pipeline probe`" in assumed["CPU Adam"]
    assert "measured on a node by `pipeline probe`" in assumed["compute efficiency"]
    # the same rate, not measured: the same point, a wider range
    fitted = estimate(shape, 4096, replace(c, measured=frozenset()), OFFLOAD)
    assert fitted.step_time_s == pytest.approx(e.step_time_s)
    width = [hi / lo for lo, hi in (e.step_time_range_s, fitted.step_time_range_s)]
    # assumed, CPU Adam ranges over what real hosts do against the formula (ASSUMED_SPREAD): 0.75x to 4.4x
    lo, hi = ASSUMED_SPREAD["cpu_adam"]
    assert width[0] < width[1] <= hi / lo * 1.0001 and width[1] > RANGE[1] / RANGE[0]
    assert width[0] >= (RANGE[1] / RANGE[0]) ** MEASURED_SPREAD * 0.9999


@pytest.mark.parametrize(
    "text,expected",
    [
        ('{"memory": {"bytes_per_s": 5e10}', "not a probe written by `pipeline probe`"),
        (json.dumps(probe_doc() | {"cpu_adam": {"params_per_s": 0}}), "a measured rate is not positive"),
        (json.dumps({"version": 1}), "not a probe written by `pipeline probe`"),
    ],
)
def test_a_damaged_probe_is_refused_naming_the_file(tmp_path: Path, text: str, expected: str) -> None:
    hf = hostfile(tmp_path)
    Path(hf + ".probe.json").write_text(text)
    with pytest.raises(PipelineError, match=expected) as e:
        cluster_from_flags(hf, 1, 1, NO_FLAGS)
    assert hf + ".probe.json" in str(e.value)
    with pytest.raises(PipelineError, match="cannot read the probe"):
        cluster_from_flags(hf, 1, 1, NO_FLAGS | {"probe": str(tmp_path / "missing.json")})


@pytest.mark.slow  # loads DeepSpeed's CPU Adam op: minutes of compiling where it is not built yet
def test_pipeline_probe_measures_this_node_and_the_plan_uses_it(tmp_path: Path) -> None:
    """The real probe (DeepSpeed's CPU Adam op, a host copy) at --quick sizes, on a node of the hostfile (this
    machine), then a plan with its hostfile."""
    hf = hostfile(tmp_path, host="localhost")
    runner = CliRunner()
    out = runner.invoke(main, ["probe", "--hostfile", hf, "--quick"])
    assert out.exit_code == 0, out.output
    doc = json.loads(Path(hf + ".probe.json").read_text())
    assert doc["gpu"] is None and doc["pinned"] is None and doc["quick"] is True
    assert doc["memory"]["bytes_per_s"] > 0 and doc["cpu_adam"]["params_per_s"] > 0
    assert f"wrote {hf}.probe.json" in out.output
    plan = runner.invoke(main, ["plan", "--hostfile", hf, "--model", "7b"])
    assert plan.exit_code == 0, plan.output
    assert "measured by pipeline probe on" in plan.output and "a --quick probe" in plan.output
    rate = doc["cpu_adam"]["params_per_s"] / 1e9
    assert f"CPU Adam {rate:.2g}e9 parameters/s per node (measured on a node by `pipeline probe`" in plan.output
    bad = runner.invoke(main, ["probe", "--out", str(tmp_path / "no" / "such" / "p.json"), "--quick"])
    assert bad.exit_code == 2 and "its folder does not exist" in bad.output


def test_a_probe_of_a_machine_outside_the_cluster_is_not_applied_without_a_word(tmp_path: Path) -> None:
    """A probe measured on another machine (a laptop, a login node) and left beside the hostfile is not the
    cluster's: not used, and the plan says why and how (newcomer trial 4); named with --probe it is used, and the
    plan says whose it is. One of a host of the hostfile is used as before."""
    hf = hostfile(tmp_path)
    before, _ = cluster_from_flags(hf, 1, 1, NO_FLAGS)
    Path(hf + ".probe.json").write_text(json.dumps(probe_doc() | {"host": "laptop.local"}))
    c, source = cluster_from_flags(hf, 1, 1, NO_FLAGS)
    assert c == before and f"not used: {hf}.probe.json was measured on laptop.local, which is not a host of" in source
    c, source = cluster_from_flags(hf, 1, 1, NO_FLAGS | {"probe": hf + ".probe.json"})
    assert c.cpu_adam_params_per_s == pytest.approx(1.5e9)
    assert "(laptop.local is not a host of " in source and "used because --probe names it)" in source
    Path(hf + ".probe.json").write_text(json.dumps(probe_doc() | {"host": "NODE1.cluster.internal"}))
    c, source = cluster_from_flags(hf, 1, 1, NO_FLAGS)
    assert c.cpu_adam_params_per_s == pytest.approx(1.5e9) and "not a host" not in source
