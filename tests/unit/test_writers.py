"""Every command that writes an output, stopped while it holds that output over an earlier one: SIGTERM (`kill`,
`docker stop`, a scheduler's time limit) and SIGINT (Ctrl-C) alike. Each stops in one line with 143 or 130, the
earlier output is left byte for byte as it was, nothing is left beside it (no temporary file or folder, no lock),
and the same command then completes. Two at once into one output: tests/unit/test_one_writer.py; `pipeline
export`, which needs a trained checkpoint: tests/multiproc/test_evaluate.py."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CORPUS, tokenizer_model
from tests.multiproc import launch
from tests.unit.test_one_writer import caught_writing

PIPELINE = str(Path(sys.executable).parent / "pipeline")


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (its name relative to it) and its contents' sha256."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def stopped_holding(cmd: list[str], lock: Path, sig: int) -> subprocess.CompletedProcess:
    """Run `cmd`, caught (SIGSTOP) as soon as its lock names it, then send `sig` and let it go on to handle it; its
    output and errors together (stderr and stdout both)."""
    proc = caught_writing(cmd, lock)
    os.kill(proc.pid, sig)
    os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, out)


def _tokenize(tmp: Path, tokenized: Path) -> tuple[list[str], list[str], Path, Path]:
    tok = ["--tokenizer", str(tokenizer_model(tokenized))]
    big = tmp / "big.jsonl"
    big.write_text(CORPUS.read_text() * 10)
    first = [PIPELINE, "tokenize", str(CORPUS), "--output-prefix", str(tmp / "out" / "corpus"), *tok]
    second = [PIPELINE, "tokenize", str(big), "--output-prefix", str(tmp / "out" / "corpus"), *tok]
    return first, second, tmp / "out", tmp / "out" / ".corpus.lock"


def _shard(tmp: Path, tokenized: Path) -> tuple[list[str], list[str], Path, Path]:
    args = [PIPELINE, "shard", str(tokenized), "--output", str(tmp / "shards"), "--seq-len", "64"]
    return args, [*args, "--seed", "7", "--overwrite"], tmp / "shards", tmp / ".shards.lock"


def _curate(tmp: Path, tokenized: Path) -> tuple[list[str], list[str], Path, Path]:
    args = [PIPELINE, "curate", str(CORPUS), "--output", str(tmp / "curated"), "--workers", "1"]
    return args, [*args, "--no-quality"], tmp / "curated", tmp / ".curated.lock"


def _extend_vocab(tmp: Path, tokenized: Path) -> tuple[list[str], list[str], Path, Path]:
    from tests.hf_families import write_model, write_tokenizer

    model = write_model("llama", tmp / "model", write_tokenizer(tmp / "tok"))
    thai, greek = tmp / "thai.jsonl", tmp / "greek.jsonl"
    thai.write_text("".join(json.dumps({"text": f"ก ข ค ฆ {i} ง จ ฉ ช ซ ฌ"}) + "\n" for i in range(40)))
    greek.write_text("".join(json.dumps({"text": f"α β γ δ {i} ε ζ η θ ι κ"}) + "\n" for i in range(40)))
    out = ["--output", str(tmp / "extended"), "--new-tokens", "10"]
    first = [PIPELINE, "extend-vocab", str(model), str(thai), *out]
    return first, [PIPELINE, "extend-vocab", str(model), str(greek), *out], tmp / "extended", tmp / ".extended.lock"


WRITERS: dict[str, Callable[[Path, Path], tuple[list[str], list[str], Path, Path]]] = {
    "tokenize": _tokenize,
    "shard": _shard,
    "curate": _curate,
    "extend-vocab": _extend_vocab,
}
"""Each writing command: (a first run, a second run with other input or options over the same output, the folder
the output is in or is, the lock the command holds while it writes)."""

SAYS = {
    signal.SIGTERM: (143, "terminated (SIGTERM); no partial outputs were left under final names"),
    signal.SIGINT: (130, "interrupted; no partial outputs were left under final names"),
}


@pytest.mark.slow  # each case starts the command three times as a process
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("name", sorted(WRITERS))
def test_a_writer_stopped_over_an_earlier_output_leaves_it_whole(
    tmp_path: Path, tokenized: Path, name: str, sig: int
) -> None:
    first, second, output, lock = WRITERS[name](tmp_path, tokenized)
    done = subprocess.run(first, env=launch.env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    before, around = snapshot(output), sorted(p.name for p in tmp_path.iterdir())

    stopped = stopped_holding(second, lock, sig)
    code, says = SAYS[sig]
    assert stopped.returncode == code, stopped.stderr[-3000:]
    errors = [line for line in stopped.stderr.splitlines() if line.strip()]
    assert errors[-1] == says and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert snapshot(output) == before, "the earlier output changed"
    assert sorted(p.name for p in tmp_path.iterdir()) == around, "something was left beside the output"
    assert not lock.exists() and not any(p.name.startswith(".") for p in output.iterdir() if p.name != ".gitignore")

    again = subprocess.run(second, env=launch.env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert snapshot(output) != before, "the second run did not replace the earlier output"
