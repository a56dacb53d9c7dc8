"""Weights & Biases and MLflow beside metrics.jsonl, for real and offline: W&B in its offline mode (its own run
files, read back record by record), MLflow on a local file store. A resumed run continues the same tracked run."""

from __future__ import annotations

import glob
import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.train.parts.tracking import Trackers, problems
from pipeline.train.setup.config import from_dict


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store for such uses
    return f"file:{tmp_path / 'mlruns'}"


def wandb_history(run_dir: Path, runs: int, timeout: float = 30) -> list[dict[str, Any]]:
    """The history records of W&B's offline run files under `run_dir`, in order, once `runs` files each end with
    their exit record (W&B's service may finish writing after `finish()` returns)."""
    deadline = time.time() + timeout
    while True:
        records = [_records(Path(p)) for p in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "*.wandb")))]
        done = len(records) == runs and all(r and r[-1].WhichOneof("record_type") == "exit" for r in records)
        if done or time.time() > deadline:
            break
        time.sleep(0.2)
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
        for r in records
        for rec in r
        if rec.WhichOneof("record_type") == "history"
    ]


def _records(path: Path) -> list[Any]:
    """W&B's run file: a LevelDB-style log (a 7-byte header, then 32 KiB blocks of chunks framed by checksum,
    length and type) of its protobuf records."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    if path.is_file():
        data, pos, chunk, block = path.read_bytes(), 7, b"", 32768
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:
                pos += left
                continue
            _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
            pos += 7
            if n == 0 and kind == 0:
                pos += left - 7
                continue
            chunk += data[pos : pos + n]
            pos += n
            if kind in (1, 4):  # a whole record, or the last chunk of one
                rec = pb.Record()
                rec.ParseFromString(chunk)
                chunk = b""
                out.append(rec)
    return out


def mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    import mlflow

    return [(m.step, m.value) for m in mlflow.MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)]


def config(uri: str) -> Any:
    return from_dict(
        {
            "run_dir": "runs/tracked",
            "batch": {"micro_batch_size": 1, "global_batch_size": 2},
            "train": {"max_steps": 3},
            "log": {"wandb_project": "pipeline-tests", "mlflow_tracking_uri": uri, "tracking_name": "t1"},
        }
    )


def test_records_reach_both_trackers_and_a_resume_continues_the_same_runs(tmp_path: Path, offline: str) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = config(offline)
    first = Trackers(cfg, run_dir)
    for step in (1, 2):
        first.log({"step": step, "loss": 5.0 / step, "lr": 1e-3, "grad_norm": None, "note": "text is left out"})
    first.close()
    ids = json.loads((run_dir / "tracking.json").read_text())
    again = Trackers(cfg, run_dir)  # a resumed launch
    again.log({"step": 3, "loss": 1.0, "lr": 5e-4})
    again.close()
    assert json.loads((run_dir / "tracking.json").read_text()) == ids
    losses = [(h["_step"], h["loss"]) for h in wandb_history(run_dir, runs=2) if "loss" in h]
    assert losses == [(1, 5.0), (2, 2.5), (3, 1.0)]
    assert mlflow_history(offline, ids["mlflow"], "loss") == [(1, 5.0), (2, 2.5), (3, 1.0)]
    import mlflow

    run = mlflow.MlflowClient(tracking_uri=offline).get_run(ids["mlflow"])
    assert run.data.params["optim.lr"] == str(cfg.optim.lr) and run.info.run_name == "t1"


def test_a_copied_run_folder_is_tracked_as_new_runs_and_a_moved_one_as_its_own(
    tmp_path: Path, offline: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`cp -r runs/a runs/b` and training in runs/b: it continues a's checkpoints as a branch would, but two
    trainings must not write into one tracked run, so b opens new ones (and says why). `mv runs/a runs/c` keeps
    its own: the folder its tracking.json names is gone."""
    import shutil

    cfg = config(offline)
    parent = tmp_path / "a"
    parent.mkdir()
    Trackers(cfg, parent).close()
    ids = json.loads((parent / "tracking.json").read_text())
    assert ids["folder"] == str(parent.resolve())

    shutil.copytree(parent, tmp_path / "b")
    with caplog.at_level("INFO"):
        copy = Trackers(cfg, tmp_path / "b")
    copy.close()
    copied = json.loads((tmp_path / "b" / "tracking.json").read_text())
    assert copied["mlflow"] != ids["mlflow"] and copied["wandb"] != ids["wandb"]
    assert copied["folder"] == str((tmp_path / "b").resolve())
    assert f"is a copy of {parent.resolve()}" in caplog.text
    assert json.loads((parent / "tracking.json").read_text()) == ids  # the parent's own, untouched

    shutil.move(parent, tmp_path / "c")
    moved = Trackers(cfg, tmp_path / "c")
    moved.close()
    again = json.loads((tmp_path / "c" / "tracking.json").read_text())
    assert again["mlflow"] == ids["mlflow"] and again["folder"] == str((tmp_path / "c").resolve())


def test_a_tracker_without_its_package_is_refused_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    monkeypatch.setenv("WANDB_MODE", "offline")
    found = problems(config("file:/tmp/x"))
    assert found == [
        "log.wandb_project is set but wandb is not installed here: pip install wandb (or pip install -e "
        "'.[tracking]'), or unset it"
    ]


def test_each_documented_form_is_checked_before_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's forms pass; W&B with neither a key nor offline mode, a database store without the full mlflow,
    and an unknown scheme are refused before launch with what to set."""
    for var in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no `wandb login` here
    no_key = problems(config(f"file:{tmp_path / 'mlruns'}"))
    assert len(no_key) == 1 and "W&B has no API key here" in no_key[0] and "WANDB_MODE=offline" in no_key[0]
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / "netrc").chmod(0o600)
    assert problems(config(f"file:{tmp_path / 'mlruns'}")) == []  # after `wandb login`
    assert problems(config(str(tmp_path / "mlruns"))) == []  # a plain folder
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert problems(config("http://localhost:5000")) == []
    sqlite = problems(config(f"sqlite:///{tmp_path / 'mlflow.db'}"))
    import importlib.util

    if importlib.util.find_spec("sqlalchemy") is None:  # mlflow-skinny, as `pip install -e .[tracking]` brings
        assert len(sqlite) == 1 and "needs the full mlflow package (pip install mlflow" in sqlite[0]
    assert "MLflow has no store for 'mlruns:'" in problems(config("mlruns://x"))[0]


def test_a_file_store_works_without_the_environment_variable_mlflow_asks_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow 3 refuses a folder store unless MLFLOW_ALLOW_FILE_STORE is set, which the README's form needs: the
    trainer sets it for a file: or folder URI, the user asked for one."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = from_dict(
        config(f"file:{tmp_path / 'mlruns'}").to_dict()
        | {"log": {"mlflow_tracking_uri": f"file:{tmp_path / 'mlruns'}"}}
    )
    t = Trackers(cfg, run_dir)
    t.log({"step": 1, "loss": 2.0})
    t.close()
    ids = json.loads((run_dir / "tracking.json").read_text())
    assert mlflow_history(f"file:{tmp_path / 'mlruns'}", ids["mlflow"], "loss") == [(1, 2.0)]


def test_a_tracker_that_fails_later_warns_once_and_the_run_goes_on(
    tmp_path: Path, offline: str, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    t = Trackers(config(offline), run_dir)

    def broken(numbers: dict[str, float], step: int) -> None:
        raise ConnectionError("the server went away\nsecond line")

    t.open["mlflow"].log = broken  # type: ignore[method-assign]
    with caplog.at_level("WARNING"):
        for step in (1, 2, 3):
            t.log({"step": step, "loss": 1.0})
    t.close()
    warned = [r.getMessage() for r in caplog.records if "tracking: mlflow failed" in r.getMessage()]
    assert len(warned) == 1 and "log step 1 (ConnectionError: the server went away)" in warned[0], warned
    assert "metrics.jsonl keeps the record" in warned[0]
    assert [h["loss"] for h in wandb_history(run_dir, runs=1) if "loss" in h] == [1.0, 1.0, 1.0]  # W&B went on
