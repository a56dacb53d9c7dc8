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
