"""`bench/gpu_bench.py --smoke`: every step and case of the one-call GPU benchmark runs its code path on the CPU,
so the script cannot rot between GPU leases; and its deadline drops the tail, never the head."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc import launch

pytestmark = pytest.mark.slow
BENCH = launch.ROOT / "bench" / "gpu_bench.py"


def test_gpu_bench_smoke_runs_every_case_and_keeps_every_log(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH), "--smoke", "--out", str(tmp_path)]
    out = subprocess.run(cmd, env=launch.env(compile=True), capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert not doc["preflight"]["missing"] and doc["warm_up"]["matmul"]["tflops"] > 0
    assert doc["budget_s"] is None  # no deadline: a machine busy with other work still runs every case
    names = [c["name"] for c in doc["cases"]]
    assert names == [
        "1b_zero2",
        "plain_eager",
        "1b_default",
        "1b_liger",
        "7b_2layers_offload",
        "7b_2layers_offload_liger",
        "1b_stage4",
        "1b_liger_micro16",
        "1b_liger_eager",
        "1b_compile",
        "1b_default_zero1",
        "70b_2layers",
        "70b_4layers",
        "70b_2layers_memory",
        "70b_4layers_actoffload",
        "7b_2layers_bf16states",
        "7b_2layers_zenflow",
        "7b_2layers_32k",
        "7b_2layers_32k_tiled_actoffload",
        "7b_2layers_64k_tiled_actoffload",
        "1b_muon",
        "1b_fp8",
        "1b_slices",
        "llama31_70b_2layers_32k",
        "llama31_70b_2layers_32k_documents_dense",
        "llama31_70b_2layers_32k_documents_varlen",
        "7b_2layers_32k_liger",
        "eval_7b_128k",
    ]
    ran = {c["name"]: c for c in doc["cases"] if "same_cpu_path_as" not in c}
    twins = {c["name"]: c["same_cpu_path_as"] for c in doc["cases"] if "same_cpu_path_as" in c}
    # the GPU switches fall back on the CPU, so their cases repeat the eager base's path and name it
    assert twins == {
        "1b_default": "1b_zero2",
        "1b_liger": "1b_zero2",
        "1b_liger_micro16": "1b_zero2",  # a smoke case's micro-batch is at most 4
        "1b_liger_eager": "1b_zero2",
        "7b_2layers_offload_liger": "7b_2layers_offload",
        # sizes change what the GPU measures, not the code: the 70B slices run the 7B slice's offload path
        "70b_2layers": "7b_2layers_offload",
        "70b_4layers": "7b_2layers_offload",
        "70b_2layers_memory": "7b_2layers_offload",  # the allocator's history is recorded on a CUDA device only
        "7b_2layers_32k": "7b_2layers_offload",  # a smoke case's sequence is 128 tokens
        "7b_2layers_32k_liger": "7b_2layers_offload",
        "7b_2layers_64k_tiled_actoffload": "7b_2layers_32k_tiled_actoffload",
    }
    for case in ran.values():
        assert "error" not in case and case["tokens_per_s"] > 0, case
        assert (tmp_path / "logs" / f"{case['name']}.log").stat().st_size > 0
        if case["name"] not in ("plain_eager", "1b_stage4", "eval_7b_128k"):  # beside the planner's prediction
            assert case["plan_step_time_s"] > 0 and case["plan_peak_allocated_gib"] > 0
    # planned on the host the warm-up probed, as a user's plan with a probed hostfile is
    assert (tmp_path / "host.probe.json").exists() and doc["warm_up"]["host"]["cpu_adam"]["params_per_s"] > 0
    adam = {a["figure"]: a["source"] for a in ran["7b_2layers_offload"]["plan_assumed"]}["CPU Adam"]
    assert "measured on a node by `pipeline probe`" in adam
    stage4 = ran["1b_stage4"]  # the whole path: stages 1-2, a saved checkpoint, evaluate, export, transformers
    assert stage4["eval_loss"] > 0 and stage4["reload"].startswith("LlamaForCausalLM ")
    for step in ("evaluate", "export", "reload"):
        assert (tmp_path / "logs" / f"1b_stage4_{step}.log").exists()
    # `pipeline probe --config` on the default's config: its slices, extrapolated, beside the model measured whole
    slices = ran["1b_slices"]
    assert [m["layers"] for m in slices["slices"]] == [2, 4] and slices["extrapolated_to_layers"] == 2
    assert (
        slices["extrapolated_over_whole"]["case"] == "1b_zero2" and slices["extrapolated_over_whole"]["step_time"] > 0
    )
    # long context at first contact: Llama-3.1-70B's own config (its 128K vocabulary, as int32 shards), packed and
    # with whole documents on each path; the two paths train the same losses, and the run says which it took
    long = {k: ran[f"llama31_70b_2layers_32k{k}"] for k in ("", "_documents_dense", "_documents_varlen")}
    assert long[""]["speed"]["attention_masks"] == "sdpa"
    assert long["_documents_dense"]["speed"]["attention_masks"] == "dense"
    assert long["_documents_varlen"]["speed"]["attention_masks"] == "varlen"
    assert long["_documents_dense"]["losses"] == pytest.approx(long["_documents_varlen"]["losses"], rel=1e-4)
    assert long["_documents_dense"]["plan_document_mask_gib"] > 0 == long["_documents_varlen"]["plan_document_mask_gib"]
    evaluated = ran["eval_7b_128k"]  # one card's evaluation after a saved step; on the CPU the batch asked for
    assert evaluated["eval_loss"] > 0 and evaluated["plan_eval_batch"] == 8
    assert (tmp_path / "logs" / "eval_7b_128k_evaluate.log").exists()
    assert "| 1b_zero2 |" in (tmp_path / "results.md").read_text()
    assert not list(tmp_path.glob("**/step0*")), "the benchmark leaves no checkpoint behind"


def test_the_deadline_skips_the_tail_never_the_head(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(BENCH),
        "--smoke",
        "--out",
        str(tmp_path),
        "--budget",
        "1",
        "--only",
        "plain_eager",  # the cheapest case (no launcher) as the head
        "7b_2layers_offload",
    ]
    out = subprocess.run(cmd, env=launch.env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    first, second = json.loads((tmp_path / "results.json").read_text())["cases"]
    assert first["name"] == "plain_eager" and first["tokens_per_s"] > 0  # over budget before it started: still run
    assert second["name"] == "7b_2layers_offload" and "s left" in second["skipped"]
