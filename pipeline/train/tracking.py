"""Experiment tracking beside metrics.jsonl and TensorBoard: Weights & Biases (`log.wandb_project`) and MLflow
(`log.mlflow_tracking_uri`), both off by default. Rank 0 sends each metrics record as it is written, the resolved
config once as parameters, and keeps the tracked runs' ids in RUN_DIR/tracking.json so that a resumed run
continues the same tracked run instead of starting another.

On resume metrics.jsonl drops its lines past the checkpoint; a tracker cannot: W&B keeps the steps it already
had (and ignores them when sent again), MLflow records the new values beside the old at those steps."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from pipeline.atomic import write_json
from pipeline.train.config import PretrainConfig

IDS = "tracking.json"
PACKAGES = {"wandb_project": "wandb", "mlflow_tracking_uri": "mlflow"}


def missing_packages(cfg: PretrainConfig) -> list[str]:
    """A tracker the config turns on whose package is not installed, as one line each."""
    out = []
    for field, package in PACKAGES.items():
        if getattr(cfg.log, field) and importlib.util.find_spec(package) is None:
            extra = "mlflow-skinny" if package == "mlflow" else package
            out.append(
                f"log.{field} is set but {package} is not installed here: pip install {extra} (or "
                "pip install -e '.[tracking]'), or unset it"
            )
    return out


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


class Trackers:
    """The trackers a config turns on, for rank 0. `log(record)` sends a metrics record (numbers only, at its
    step); `close()` ends the tracked runs (they stay resumable)."""

    def __init__(self, cfg: PretrainConfig, run_dir: Path):
        self.run_dir = run_dir
        self.ids: dict[str, str] = {}
        if (run_dir / IDS).is_file():
            self.ids = json.loads((run_dir / IDS).read_text())
        name = cfg.log.tracking_name or run_dir.name
        params = flat(cfg.to_dict())
        self.wandb: Any = None
        self.mlflow: Any = None
        if cfg.log.wandb_project:
            import wandb

            self.wandb = wandb.init(
                project=cfg.log.wandb_project,
                entity=cfg.log.wandb_entity,
                name=name,
                id=self.ids.get("wandb"),
                resume="allow",
                dir=str(run_dir),
                config=params,
            )
            self.ids["wandb"] = self.wandb.id
        if cfg.log.mlflow_tracking_uri:
            import mlflow

            mlflow.set_tracking_uri(cfg.log.mlflow_tracking_uri)
            mlflow.set_experiment(cfg.log.mlflow_experiment)
            resumed = "mlflow" in self.ids
            self.mlflow = mlflow.start_run(run_id=self.ids.get("mlflow"), run_name=None if resumed else name)
            if not resumed:  # parameters are immutable in MLflow: logged once, by the run that starts
                mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
            self.ids["mlflow"] = self.mlflow.info.run_id
        if self.ids:
            write_json(run_dir / IDS, self.ids)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        numbers = {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)
        if self.mlflow is not None:
            import mlflow

            mlflow.log_metrics(numbers, step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.mlflow is not None:
            import mlflow

            mlflow.end_run()
            self.mlflow = None
