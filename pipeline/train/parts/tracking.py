"""Experiment tracking beside metrics.jsonl and TensorBoard: Weights & Biases (`log.wandb_project`) and MLflow
(`log.mlflow_tracking_uri`), both off by default. Rank 0 sends each metrics record as it is written, the resolved
config once as parameters, and keeps the tracked runs' ids in RUN_DIR/tracking.json so that a resumed run
continues the same tracked run instead of starting another.

On resume metrics.jsonl drops its lines past the checkpoint; a tracker cannot: W&B keeps the steps it already
had (and ignores them when sent again), MLflow records the new values beside the old at those steps.

metrics.jsonl is the record; a dashboard is not worth a lost run. Before launch each tracker is checked as far as
it can be (`problems`: its package, its store, its credentials or offline mode); a tracker that fails later warns
once and the run goes on without it."""

from __future__ import annotations

import importlib.util
import json
import logging
import netrc
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from pipeline.atomic import write_json
from pipeline.train.setup.config import PretrainConfig

IDS = "tracking.json"
log = logging.getLogger(__name__)


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


def _wandb_problem(cfg: PretrainConfig) -> str | None:
    """W&B without a key and not offline fails at rank 0's first call, after the launch."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):  # what `wandb login` writes
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return (
        "log.wandb_project is set but W&B has no API key here (WANDB_API_KEY, or `wandb login`) and WANDB_MODE is "
        "not offline: set a key, or WANDB_MODE=offline to keep the run in RUN_DIR/wandb and `wandb sync` it later"
    )


DATABASES = ("sqlite", "postgresql", "mysql", "mssql")
"""MLflow's database stores (a URI scheme, maybe with +driver): they need the full `mlflow` package."""


def _mlflow_problem(cfg: PretrainConfig) -> str | None:
    uri = str(cfg.log.mlflow_tracking_uri)
    scheme = urlparse(uri).scheme.split("+")[0]
    if scheme in DATABASES and importlib.util.find_spec("sqlalchemy") is None:
        return (
            f"log.mlflow_tracking_uri {uri}: a database store needs the full mlflow package (pip install mlflow; "
            "mlflow-skinny has none), or use a folder: file:/path/to/mlruns"
        )
    if scheme not in ("", "file", "http", "https", "databricks", *DATABASES):
        return (
            f"log.mlflow_tracking_uri {uri}: MLflow has no store for '{scheme}:'; use file:/path/to/mlruns, "
            "http(s)://server:5000, or a database such as sqlite:////path/to/mlflow.db"
        )
    return None


class _Mlflow:
    def __init__(self, cfg: PretrainConfig, run_dir: Path, name: str, params: dict[str, Any], run_id: str | None):
        import mlflow

        if urlparse(str(cfg.log.mlflow_tracking_uri)).scheme in ("", "file"):
            # MLflow 3 refuses a folder store unless told; docs/pretrain.md offers one: the user asked for it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

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
    problem: Callable[[PretrainConfig], str | None]
    """What would make it fail after the launch, checked before (its store, its credentials), or None."""


BACKENDS: dict[str, Backend] = {
    "wandb": Backend("wandb_project", "wandb", "wandb", _Wandb, _wandb_problem),
    "mlflow": Backend("mlflow_tracking_uri", "mlflow", "mlflow-skinny", _Mlflow, _mlflow_problem),
}
"""Every tracking backend, by the name its run id is kept under in RUN_DIR/tracking.json. A new one is an entry
here (and its `log` field in pipeline.train.setup.config); nothing else names a backend."""


def enabled(cfg: PretrainConfig) -> dict[str, Backend]:
    return {name: b for name, b in BACKENDS.items() if getattr(cfg.log, b.field)}


def problems(cfg: PretrainConfig) -> list[str]:
    """Each tracker the config turns on that would fail after the launch (its package not installed, a store it
    cannot use, no credentials), as one line each."""
    out = []
    for b in enabled(cfg).values():
        if importlib.util.find_spec(b.package) is None:
            out.append(
                f"log.{b.field} is set but {b.package} is not installed here: pip install {b.pip} (or "
                "pip install -e '.[tracking]'), or unset it"
            )
        elif problem := b.problem(cfg):
            out.append(problem)
    return out


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


FOLDER = "folder"
"""tracking.json's record of the run folder it was written in: a copy of the folder is told from the folder itself."""


def tracked_ids(run_dir: Path) -> dict[str, str]:
    """The tracked runs this run folder continues (RUN_DIR/tracking.json). A folder copied from another run
    (`cp -r runs/a runs/b`: its tracking.json names runs/a, which still holds it) continues that run's checkpoints
    as a branch would, but not its tracked runs: two trainings would write into one dashboard run. A folder that
    was moved (the one named is gone) continues its own."""
    path = run_dir / IDS
    if not path.is_file():
        return {}
    ids = {k: str(v) for k, v in json.loads(path.read_text()).items()}
    written_in = ids.pop(FOLDER, None)
    if written_in and Path(written_in) != run_dir.resolve() and (Path(written_in) / IDS).is_file():
        log.info(
            "note: %s is a copy of %s (its %s was written there): it continues that run's checkpoints as a branch "
            "would, and is tracked as new runs, not in %s's",
            run_dir,
            written_in,
            IDS,
            Path(written_in).name,
        )
        return {}
    return ids


class Trackers:
    """The trackers a config turns on, for rank 0. `log(record)` sends a metrics record (numbers only, at its
    step); `close()` ends the tracked runs (they stay resumable)."""

    def __init__(self, cfg: PretrainConfig, run_dir: Path):
        self.ids = tracked_ids(run_dir)
        name = cfg.log.tracking_name or run_dir.name
        params = flat(cfg.to_dict())
        self.open: dict[str, Tracker] = {}
        for key, backend in enabled(cfg).items():
            try:
                self.open[key] = backend.open(cfg, run_dir, name, params, self.ids.get(key))
            except Exception as e:  # noqa: BLE001 - any failure of a tracker's library: the run goes on
                self._failed(key, "start", e)
                continue
            self.ids[key] = self.open[key].run_id
        if self.ids:
            write_json(run_dir / IDS, {**self.ids, FOLDER: str(run_dir.resolve())})

    def _failed(self, key: str, doing: str, e: Exception) -> None:
        """Warn once and go on without the tracker."""
        self.open.pop(key, None)
        log.warning(
            "warning: tracking: %s failed to %s (%s: %s); the run goes on without it, metrics.jsonl keeps the record",
            key,
            doing,
            type(e).__name__,
            str(e).splitlines()[0][:300] if str(e) else "",
        )

    @classmethod
    def factory(cls, cfg: PretrainConfig, run_dir: Path) -> Callable[[], Trackers] | None:
        """What opens the config's trackers on rank 0; None when it turns none on."""
        return (lambda: cls(cfg, run_dir)) if enabled(cfg) else None

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        numbers = {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        for key, tracker in list(self.open.items()):
            try:
                tracker.log(numbers, step)
            except Exception as e:  # noqa: BLE001 - see _failed
                self._failed(key, f"log step {step}", e)

    def close(self) -> None:
        for key, tracker in list(self.open.items()):
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001 - see _failed
                self._failed(key, "close", e)
        self.open = {}
