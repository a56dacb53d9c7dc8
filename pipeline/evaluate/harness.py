"""EleutherAI's lm-evaluation-harness on a checkpoint: export it to RUN_DIR/export/TAG when that export is missing or
stale, then run the harness's `lm_eval` (installed in its own environment, see `make eval TASKS=...`: it pins its own
dependencies) on the export. Tasks are the harness's own (downloaded on first use) or local YAML files under
configs/lm_eval/, which run offline."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.evaluate.config import HarnessConfig
from pipeline.evaluate.export import export
from pipeline.evaluate.inputs import RunFolder, open_run

LOCAL_TASKS = Path(__file__).resolve().parents[2] / "configs" / "lm_eval"
STAMP = "pipeline_export.json"
"""Written into an export: which checkpoint (and which save of it) it was made from."""


def _identity(r: RunFolder, dtype: str) -> dict[str, str]:
    marker = hashlib.sha256(json.dumps(r.marker, sort_keys=True, default=str).encode()).hexdigest()
    return {"checkpoint": str(r.run_dir / r.tag), "marker_sha256": marker, "dtype": dtype}


def export_if_needed(checkpoint: str, dtype: str = "bf16") -> tuple[Path, bool]:
    """(RUN_DIR/export/TAG, whether it was written now): exported again only when the checkpoint (or its dtype)
    differs from the one the folder was made from."""
    r = open_run(checkpoint)
    out = r.run_dir / "export" / r.tag
    want = _identity(r, dtype)
    stamp = out / STAMP
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == want:
                return out, False
        except json.JSONDecodeError:
            pass
    export(str(r.run_dir / r.tag), str(out), dtype=dtype)
    stamp.write_text(json.dumps(want, indent=2))
    return out, True


def lm_eval_command(
    lm_eval: str,
    model_dir: Path,
    tasks: str,
    output: Path,
    *,
    device: str,
    batch_size: str,
    limit: float | None = None,
    include: Path = LOCAL_TASKS,
) -> list[str]:
    cmd = [
        lm_eval,
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model_dir},dtype=auto",
        "--tasks",
        tasks,
        "--include_path",
        str(include),
        "--device",
        device,
        "--batch_size",
        batch_size,
        "--output_path",
        str(output),
    ]
    return cmd + (["--limit", f"{limit:g}"] if limit is not None else [])


def run_harness(cfg: HarnessConfig) -> tuple[int, Path]:
    """Export if needed, then run the harness; returns its exit code and the results folder
    (RUN_DIR/eval/TAG-lm-eval). Its table goes to this process's standard output."""
    if not Path(cfg.lm_eval).is_file():
        raise PipelineError(
            f"--lm-eval {cfg.lm_eval}: not found; `make eval TASKS=...` installs the harness into its "
            "own environment (.venv-lm-eval), or pip install 'lm-eval[hf]' elsewhere and pass its "
            "lm_eval"
        )
    device = cfg.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir, _ = export_if_needed(cfg.checkpoint, cfg.dtype)
    r = open_run(cfg.checkpoint)
    output = r.run_dir / "eval" / f"{r.tag}-lm-eval"
    cmd = lm_eval_command(
        os.path.abspath(cfg.lm_eval),
        model_dir.absolute(),
        cfg.tasks,
        output.absolute(),
        device=device,
        batch_size=cfg.batch_size,
        limit=cfg.limit,
    )
    # Started in the local tasks' folder: their data paths are relative to it.
    return subprocess.call(cmd, cwd=LOCAL_TASKS), output
