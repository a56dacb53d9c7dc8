"""Experiment tracking beside metrics.jsonl and TensorBoard: Weights & Biases (`log.wandb_project`) and MLflow
(`log.mlflow_tracking_uri`), both off by default. Rank 0 sends each metrics record as it is written, the resolved
config once as parameters, and keeps the tracked runs' ids in RUN_DIR/tracking.json so that a resumed run
continues the same tracked run instead of starting another.

On resume metrics.jsonl drops its lines past the checkpoint; a tracker cannot: W&B keeps the steps it already
had (and ignores them when sent again), MLflow records the new values beside the old at those steps."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pipeline.atomic import write_json
from pipeline.train.config import PretrainConfig

IDS = "tracking.json"


class Tracker(Protocol):
    """One tracking backend's open run: `log` a metrics record's numbers at its step, `close` the run (it stays
    resumable), `run_id` to continue it on resume."""

    run_id: str

    def log(self, numbers: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class _Wandb:
    def __init__(self, cfg: PretrainConfig, run_dir: Path, name: str, params: dict[str, Any], run_id: str | None):
        import wandb

        self.run = wandb.init(
            project=cfg.log.wandb_project,
            entity=cfg.log.wandb_entity,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=params,
        )
        self.run_id = str(self.run.id)

    def log(self, numbers: dict[str, float], step: int) -> None:
        self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, cfg: PretrainConfig, run_dir: Path, name: str, params: dict[str, Any], run_id: str | None):
        import mlflow

        mlflow.set_tracking_uri(str(cfg.log.mlflow_tracking_uri))
        mlflow.set_experiment(cfg.log.mlflow_experiment)
        self.run_id = str(mlflow.start_run(run_id=run_id, run_name=None if run_id else name).info.run_id)
        if not run_id:  # parameters are immutable in MLflow: logged once, by the run that starts
            mlflow.log_params({k: str(v)[:500] for k, v in params.items()})

    def log(self, numbers: dict[str, float], step: int) -> None:
        import mlflow

        mlflow.log_metrics(numbers, step=step)

    def close(self) -> None:
        import mlflow

        mlflow.end_run()


@dataclass(frozen=True, slots=True)
class Backend:
    """A tracking backend: the `log` field that turns it on, the package it needs (and the pip name to install),
    and how to open its run."""

    field: str
    package: str
    pip: str
    open: Callable[[PretrainConfig, Path, str, dict[str, Any], str | None], Tracker]


BACKENDS: dict[str, Backend] = {
    "wandb": Backend("wandb_project", "wandb", "wandb", _Wandb),
    "mlflow": Backend("mlflow_tracking_uri", "mlflow", "mlflow-skinny", _Mlflow),
}
"""Every tracking backend, by the name its run id is kept under in RUN_DIR/tracking.json. A new one is an entry
here (and its `log` field in pipeline.train.config); nothing else names a backend."""


def enabled(cfg: PretrainConfig) -> dict[str, Backend]:
    return {name: b for name, b in BACKENDS.items() if getattr(cfg.log, b.field)}


def missing_packages(cfg: PretrainConfig) -> list[str]:
    """A tracker the config turns on whose package is not installed, as one line each."""
    return [
        f"log.{b.field} is set but {b.package} is not installed here: pip install {b.pip} (or "
        "pip install -e '.[tracking]'), or unset it"
        for b in enabled(cfg).values()
        if importlib.util.find_spec(b.package) is None
    ]


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
        self.ids: dict[str, str] = json.loads((run_dir / IDS).read_text()) if (run_dir / IDS).is_file() else {}
        name = cfg.log.tracking_name or run_dir.name
        params = flat(cfg.to_dict())
        self.open: dict[str, Tracker] = {}
        for key, backend in enabled(cfg).items():
            self.open[key] = backend.open(cfg, run_dir, name, params, self.ids.get(key))
            self.ids[key] = self.open[key].run_id
        if self.ids:
            write_json(run_dir / IDS, self.ids)

    @classmethod
    def factory(cls, cfg: PretrainConfig, run_dir: Path) -> Callable[[], Trackers] | None:
        """What opens the config's trackers on rank 0; None when it turns none on."""
        return (lambda: cls(cfg, run_dir)) if enabled(cfg) else None

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        numbers = {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        for tracker in self.open.values():
            tracker.log(numbers, step)

    def close(self) -> None:
        for tracker in self.open.values():
            tracker.close()
        self.open = {}
