"""One live writer per output, for every stage (pretrain's run folder: tests/unit/train/setup/test_runlock.py): two
real `pipeline
tokenize` processes into one prefix, two `pipeline shard` into one folder. The first is caught holding its output
(SIGSTOP once its lock names it), the second is refused naming it, and the first then finishes whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import CORPUS, tokenizer_model
from tests.multiproc import launch

PIPELINE = str(Path(sys.executable).parent / "pipeline")


def caught_writing(cmd: list[str], lock: Path) -> subprocess.Popen:
    """Start `cmd` and stop it (SIGSTOP) as soon as its lock file names it: it holds its output."""
    proc = subprocess.Popen(cmd, env=launch.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads(lock.read_text() or "{}").get("pid") == proc.pid:
                os.kill(proc.pid, signal.SIGSTOP)
                return proc
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    raise AssertionError(f"{cmd[1]} never held {lock}: {proc.communicate()[0][-2000:]}")


def refused_then_first_finishes(first: subprocess.Popen, second: list[str], says: str) -> None:
    try:
        out = subprocess.run(second, env=launch.env(), capture_output=True, text=True, timeout=120)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert out.returncode == 2 and says in out.stderr and f"(pid {first.pid} on " in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    output, _ = first.communicate(timeout=300)
    assert first.returncode == 0, output[-3000:]


def test_two_tokenize_into_one_prefix_and_two_shard_into_one_folder(tmp_path: Path, tokenized: Path) -> None:
    big = tmp_path / "big.jsonl"  # large enough that the first run is still writing when it is caught
    big.write_text(CORPUS.read_text() * 20)
    prefix = tmp_path / "out" / "same"
    tok = ["--tokenizer", str(tokenizer_model(tokenized)), "--workers", "1"]
    first = caught_writing(
        [PIPELINE, "tokenize", str(big), "--output-prefix", str(prefix), *tok], tmp_path / "out" / ".same.lock"
    )
    second = [PIPELINE, "tokenize", str(CORPUS), "--output-prefix", str(prefix), *tok]
    refused_then_first_finishes(first, second, "another `pipeline tokenize` is writing it")
    manifest = json.loads(Path(f"{prefix}.manifest.json").read_text())
    assert manifest["inputs"][0]["path"].endswith("big.jsonl")  # the first one's documents, whole

    shards = tmp_path / "shards"
    args = [str(prefix), "--output", str(shards), "--seq-len", "64"]
    first = caught_writing([PIPELINE, "shard", *args], tmp_path / ".shards.lock")
    refused_then_first_finishes(first, [PIPELINE, "shard", *args], "another `pipeline shard` is writing it")
    assert (shards / "manifest.json").exists()


def test_every_folder_written_whole_has_one_live_writer(tmp_path: Path) -> None:
    """curate, extend-vocab and export write their output through one temporary folder beside it, which a second
    writer at once used to clear under the first (newcomer trial 4): the second is refused in one line naming
    the holder, and the first's folder is untouched. Here the first holds the output's lock as a live command does."""
    import json

    from click.testing import CliRunner

    from pipeline.atomic import OneWriter, replacing_dir
    from pipeline.cli import main
    from pipeline.errors import PipelineError
    from tests.hf_families import write_model, write_tokenizer

    model = write_model("llama", tmp_path / "m", write_tokenizer(tmp_path / "tok"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"ก ข ค ฆ {i} ง จ ฉ ช ซ ฌ"}) + "\n" for i in range(40)))
    commands = {
        "curate": ["curate", str(CORPUS), "--no-quality", "--output"],
        "extend-vocab": ["extend-vocab", str(model), str(corpus), "--new-tokens", "20", "--output"],
    }
    for name, args in commands.items():
        out = tmp_path / f"out-{name}"
        with OneWriter(tmp_path / f".{out.name}.lock", lambda who: "held"):
            r = CliRunner().invoke(main, [*args, str(out)])
        assert r.exit_code == 2, r.output
        assert f"another `pipeline {name}` is writing it (pid {os.getpid()} on " in r.output, r.output
        assert not out.exists() and not (tmp_path / f".{out.name}.tmp").exists()
    out = tmp_path / "export"  # pipeline export's writer: the same folder discipline
    with OneWriter(tmp_path / ".export.lock", lambda who: "held"), pytest.raises(PipelineError, match="is writing it"):
        with replacing_dir(out, "another `pipeline export`"):
            pass
    with replacing_dir(out) as work:  # the lock released: the next writer goes ahead
        (work / "x").write_text("x")
    assert (out / "x").read_text() == "x" and not (tmp_path / ".export.lock").exists()
