"""Every list a user gives is checked for repeats, in every form a repeat takes: the inputs of tokenize (the same
file named twice, by a glob and by name, through its folder, by another spelling, a symlink or a hard link), the
prefixes of shard, the hosts of a hostfile. Each is one line naming both."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pipeline.data.config import parse_sources
from pipeline.data.readers import resolve_inputs
from pipeline.errors import PipelineError
from pipeline.plan.hostfile import hostfile_hosts
from tests.conftest import CORPUS


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    shutil.copyfile(CORPUS, tmp_path / "data" / "a.jsonl")
    shutil.copyfile(CORPUS, tmp_path / "data" / "b.jsonl")  # same content, another file: not a repeat
    os.symlink(tmp_path / "data" / "a.jsonl", tmp_path / "link.jsonl")
    os.link(tmp_path / "data" / "a.jsonl", tmp_path / "hard.jsonl")
    return tmp_path


@pytest.mark.parametrize(
    "given, says",
    [
        (["data/a.jsonl", "data/a.jsonl"], "data/a.jsonl and data/a.jsonl are the same file: "),
        (["data/*.jsonl", "data/a.jsonl"], "are the same file: its documents would be read twice"),
        (["data", "data/b.jsonl"], "data/b.jsonl and data/b.jsonl are the same file"),
        (["data/a.jsonl", "./data/../data/a.jsonl"], "by another path"),
        (["data/a.jsonl", "link.jsonl"], "data/a.jsonl and link.jsonl are the same file, by another path"),
        (["data/a.jsonl", "hard.jsonl"], "through a hard link"),
    ],
)
def test_an_input_given_twice_is_refused_in_every_form(
    corpus: Path, given: list[str], says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(corpus)
    with pytest.raises(PipelineError, match=says.replace("(", r"\(").replace(".", r"\.")):
        resolve_inputs(given)


def test_distinct_files_with_the_same_content_are_not_repeats(corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(corpus)
    assert [s.path.name for s in resolve_inputs(["data/a.jsonl", "data/b.jsonl"])] == ["a.jsonl", "b.jsonl"]


@pytest.mark.parametrize("second", ["{t}", "{t}:2", "{dir}/./{name}", "{link}"])
def test_a_shard_source_given_twice_is_refused_with_the_weight_to_use(
    tokenized: Path, tmp_path: Path, second: str
) -> None:
    link = tmp_path / "alias"
    for ext in (".bin", ".idx", ".manifest.json"):
        os.symlink(str(tokenized) + ext, str(link) + ext)
    spec = second.format(t=tokenized, link=link, dir=tokenized.parent, name=tokenized.name)
    with pytest.raises(PipelineError, match=r"are the same tokenize output: it would be blended twice; .*:2"):
        parse_sources((str(tokenized), spec))


@pytest.mark.parametrize("again", ["node-a slots=1", "node-a slots=4", "node-a  slots=1 # again"])
def test_a_host_listed_twice_is_refused_naming_both_lines(tmp_path: Path, again: str) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# cluster\nnode-a slots=1\nnode-b slots=1\n{again}\n")
    with pytest.raises(PipelineError, match=rf"{hostfile}:4: host node-a is listed again \(first on line 2\)"):
        hostfile_hosts(str(hostfile))
