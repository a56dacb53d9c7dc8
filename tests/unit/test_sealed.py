"""Everything a stage wrote and a later one reads is verified against what was written, every field: the tokenize
and shard manifests and the checkpoint markers carry a seal (the sha256 of their other fields); any field changed
after writing (a number, a nested value, a name, a field added or removed) is one line naming the file, while files
written before seals are taken as they are."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline.atomic import SEAL
from pipeline.data.loader import ShardedDataset
from pipeline.data.manifest import read_tokenize_manifest
from pipeline.errors import PipelineError
from pipeline.train.checkpoint import files as ckpt
from tests.conftest import shard_into

EDITS: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("a number", lambda m: m.update({k: v + 1 for k, v in list(m.items())[:50] if type(v) is int} or {"x": 1})),
    ("a nested value", lambda m: next(v for v in m.values() if isinstance(v, dict)).update({"edited": True})),
    ("a string", lambda m: m.update({k: v + "x" for k, v in m.items() if isinstance(v, str) and k != SEAL})),
    ("a field added", lambda m: m.update({"note": "mine"})),
    ("a field removed", lambda m: m.pop(next(k for k in m if k != SEAL))),
]


def edit(path: Path, how: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    assert SEAL in data
    how(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("what, how", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_manifest_or_marker_is_refused_naming_the_file(
    tokenized: Path, tmp_path: Path, what: str, how: Callable[[dict[str, Any]], None]
) -> None:
    prefix = tmp_path / "tok" / "corpus"
    prefix.parent.mkdir()
    for ext in (".bin", ".idx", ".manifest.json", ".tokenizer.model"):
        shutil.copyfile(str(tokenized) + ext, str(prefix) + ext)
    shards = tmp_path / "shards"
    shard_into([(prefix, 1.0)], shards, seq_len=64, split=(80.0, 10.0, 10.0))
    edit(Path(str(prefix) + ".manifest.json"), how)
    with pytest.raises(PipelineError, match=r"corpus\.manifest\.json: changed after it was written"):
        read_tokenize_manifest(prefix)
    edit(shards / "manifest.json", how)
    with pytest.raises(PipelineError, match=r"shards/manifest\.json: changed after it was written"):
        ShardedDataset(shards, "train")
    run = tmp_path / "run"
    (run / "step00000005").mkdir(parents=True)
    ckpt.mark_complete(
        run, "step00000005", {"step": 5, "consumed_samples": 40, "data_fingerprint": "fp", "model_shape": {"h": 8}}
    )  # type: ignore[typeddict-item]
    edit(run / "step00000005" / ckpt.MARKER, how)
    with pytest.raises(PipelineError, match=r"step00000005/pipeline_complete\.json: changed after the save wrote it"):
        ckpt.read_marker(run, "step00000005")


def test_files_written_before_seals_are_read_as_they_are(shards: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(shards, old)
    data = json.loads((old / "manifest.json").read_text())
    del data[SEAL]
    (old / "manifest.json").write_text(json.dumps(data))
    assert len(ShardedDataset(old, "train")) == len(ShardedDataset(shards, "train"))
    (tmp_path / "run" / "step00000001").mkdir(parents=True)
    (tmp_path / "run" / "step00000001" / ckpt.MARKER).write_text(json.dumps({"step": 1}))
    assert ckpt.read_marker(tmp_path / "run", "step00000001") == {"step": 1}


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.replace("data:", "data:\n  num_workers: 4\n  _x:", 1),  # a field added
        lambda t: t.replace("seed: 1234", "seed: 1235"),  # a number
        lambda t: t + "\n",  # a trailing line
    ],
)
def test_the_config_beside_a_run_is_what_the_run_wrote(tmp_path: Path, edit: Callable[[str], str]) -> None:
    """RUN_DIR/config.yaml says what the run trained with (its data, model, paths): evaluate, export, harness and
    plan --from-run read it; an edited copy is refused naming it, an older unsealed one taken as it is."""
    from pipeline.atomic import sealed_text
    from pipeline.train.setup.config import dump_for_the_run, from_dict

    raw = {"run_dir": "runs/r", "batch": {"micro_batch_size": 1, "global_batch_size": 1}, "train": {"max_steps": 3}}
    text = sealed_text(dump_for_the_run(from_dict(raw), tmp_path))
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    assert ckpt.run_config_text(tmp_path) == text
    cfg.write_text(edit(text))
    with pytest.raises(PipelineError, match="config.yaml: changed after the run wrote it"):
        ckpt.run_config_text(tmp_path)
    cfg.write_text(edit(text).partition("\n")[2])  # written before seals: taken as it is
    assert ckpt.run_config_text(tmp_path) == edit(text).partition("\n")[2]
