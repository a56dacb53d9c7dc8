"""Every path a user types means what they meant: a leading ~ is their home wherever it is typed (a quoted
argument, a YAML field, a script), and an output prefix that names a folder (`data/`, or an existing folder) is
refused instead of writing `data.bin` beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.train.setup.config import from_dict
from tests.conftest import CORPUS, tokenizer_model


@pytest.mark.parametrize("prefix", ["out/", "out//", "{tmp}/out/", "existing", "{tmp}/existing"])
def test_an_output_prefix_naming_a_folder_is_one_line_and_writes_nothing(
    tokenized: Path, tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing").mkdir()
    given = prefix.format(tmp=tmp_path)
    args = ["tokenize", str(CORPUS), "--output-prefix", given, "--tokenizer", str(tokenizer_model(tokenized))]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "names a folder; give a file prefix inside it, e.g. " in result.output
    assert "Traceback" not in result.output
    assert not list(tmp_path.glob("*.bin")) and not list((tmp_path / "existing").iterdir())


def test_a_tilde_is_the_users_home_in_arguments_and_in_the_config(
    tokenized: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    tok = str(tokenizer_model(tokenized))
    result = CliRunner().invoke(main, ["tokenize", str(CORPUS), "--output-prefix", "~/tok/corpus", "--tokenizer", tok])
    assert result.exit_code == 0, result.output
    assert (home / "tok" / "corpus.bin").is_file() and not (tmp_path / "~").exists()
    result = CliRunner().invoke(main, ["shard", "~/tok/corpus", "--output", "~/shards", "--seq-len", "64"])
    assert result.exit_code == 0, result.output
    assert (home / "shards" / "manifest.json").is_file() and not (tmp_path / "~").exists()
    cfg = from_dict(
        {
            "run_dir": "~/runs/x",
            "data": {"path": "~/shards", "stages": {5: "~/later"}},
            "model": {"init_from": "~/models/m"},
            "checkpoint": {"branch_from": "~/runs/y"},
            "batch": {"global_batch_size": 2},
            "train": {"max_steps": 10, "deepspeed_config": "~/ds.json"},
        }
    )
    assert cfg.run_dir == str(home / "runs/x") and cfg.data.path == str(home / "shards")
    assert cfg.data.stages == {5: str(home / "later")} and cfg.model.init_from == str(home / "models/m")
    assert cfg.checkpoint.branch_from == str(home / "runs/y") and cfg.train.deepspeed_config == str(home / "ds.json")


def test_the_run_keeps_its_paths_as_they_were_meant_where_it_was_launched(tmp_path: Path) -> None:
    """RUN_DIR/config.yaml holds data.path, the stages, the DeepSpeed JSON and init_from absolute, resolved against
    the launch folder: `evaluate` and `export` run from anywhere read the run's own shards and tokenizer."""
    import yaml

    from pipeline.train.setup.config import dump_for_the_run

    raw = {
        "run_dir": "runs/r",
        "data": {"path": "data/shards", "stages": {10: "data/curated", 20: "/abs/stage"}},
        "batch": {"micro_batch_size": 1, "global_batch_size": 1},
        "train": {"max_steps": 30, "deepspeed_config": "auto"},
    }
    saved = yaml.safe_load(dump_for_the_run(from_dict(raw), tmp_path))
    assert saved["data"]["path"] == str(tmp_path / "data" / "shards")
    assert saved["data"]["stages"] == {10: str(tmp_path / "data" / "curated"), 20: "/abs/stage"}
    assert saved["train"]["deepspeed_config"] == "auto" and saved["model"]["init_from"] is None
    assert saved["run_dir"] == "runs/r"  # the folder the commands are given, as given


def test_an_older_runs_relative_data_path_is_read_from_where_it_was_launched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.evaluate.inputs import RunFolder
    from pipeline.model import ModelShape

    (tmp_path / "proj" / "data" / "shards").mkdir(parents=True)
    (tmp_path / "proj" / "runs" / "r").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    shape = ModelShape(hidden_size=8, num_layers=1, ffn_hidden_size=8, num_heads=1, num_kv_heads=1)
    config = {"run_dir": "runs/r", "data": {"path": "data/shards"}}
    run = RunFolder(tmp_path / "proj" / "runs" / "r", "step00000001", config, {}, shape)  # type: ignore[arg-type]
    assert run.path("data/shards") == tmp_path / "proj" / "data" / "shards"
    assert run.path("data/missing") == Path("data/missing")  # not there either: said by the caller
    assert run.path(str(tmp_path)) == tmp_path
