"""Shared fixtures: a real sentencepiece tokenizer trained on the fixture corpus, and real shards built from it.
The launcher runs that several multi-process tests share are in tests/multiproc/conftest.py."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.data import shard as shard_stage
from pipeline.data import tokenize as tokenizing
from pipeline.data.config import ShardConfig, TokenizeConfig

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
CORPUS = FIXTURES / "corpus.jsonl"

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def tokenized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PREFIX of the fixture corpus tokenized with a freshly trained 600-piece BPE model."""
    prefix = tmp_path_factory.mktemp("tok") / "corpus"
    tokenizing.run(
        TokenizeConfig(
            inputs=(str(CORPUS),),
            output_prefix=str(prefix),
            train_tokenizer=True,
            vocab_size=600,
            workers=1,
            progress=False,
        )
    )
    return prefix


@pytest.fixture(scope="session")
def shards(tokenized: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "seq64"
    shard_stage.run(
        ShardConfig(
            sources=((str(tokenized), 1.0),), output=str(out), seq_len=64, split=(80.0, 10.0, 10.0), progress=False
        )
    )
    return out


@pytest.fixture(scope="session")
def two_sources(tokenized: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shards of a blend of two sources, `first` (the corpus's first half) and `second` (its other half), with
    the fixture tokenizer, 32-token samples, train/val/test 80/10/10."""
    from pipeline.data.config import ShardConfig

    work = tmp_path_factory.mktemp("two_sources")
    lines = CORPUS.read_text().splitlines(keepends=True)
    half = len(lines) // 2
    for name, part in (("first", lines[:half]), ("second", lines[half:])):
        (work / f"{name}.jsonl").write_text("".join(part))
        tokenize_with(work / name, [str(work / f"{name}.jsonl")], Path(f"{tokenized}.tokenizer.model"))
    out = work / "blend"
    srcs = ((str(work / "first"), 0.5), (str(work / "second"), 0.5))
    shard_stage.run(
        ShardConfig(
            sources=srcs, output=str(out), seq_len=32, split=(80.0, 10.0, 10.0), weights_given=True, progress=False
        )
    )
    return out


def tokenize_with(prefix: Path, inputs: list[str], tokenizer: Path, **kw: Any) -> Any:
    """`pipeline tokenize` of `inputs` into `prefix` with an existing tokenizer, quietly."""
    from pipeline.data import tokenize as tokenizing
    from pipeline.data.config import TokenizeConfig

    return tokenizing.run(
        TokenizeConfig(inputs=tuple(inputs), output_prefix=str(prefix), tokenizer=str(tokenizer), progress=False, **kw)
    )


def bench_module(name: str) -> Any:
    """bench/NAME.py as a module (the benchmarks are scripts, not a package): its corpus generators and
    re-planning functions are what some tests check against."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "bench" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def tokenizer_model(tokenized: Path) -> Path:
    """The sentencepiece model `pipeline tokenize --train-tokenizer` wrote beside `tokenized`."""
    return Path(str(tokenized) + ".tokenizer.model")


def shard_into(sources: list[tuple[Path, float]], out: Path, **kw: Any) -> Any:
    """`pipeline shard` of (prefix, weight) pairs into `out`, quietly."""
    from pipeline.data import shard as shard_stage
    from pipeline.data.config import ShardConfig

    srcs = tuple((str(p), w) for p, w in sources)
    return shard_stage.run(ShardConfig(sources=srcs, output=str(out), progress=False, **kw))


Mount = Callable[..., Path]


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Mount]:
    """mount(size, ro=False): a fresh tmpfs of `size` (e.g. 100k), unmounted after the test; `remount(where,
    size)` grows it (a user freeing space). Root only: skipped elsewhere, with the reason."""
    import subprocess

    mounted: list[Path] = []

    def make(size: str, ro: bool = False) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        options = f"size={size}" + (",ro" if ro else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): the disk cases need root")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def remount(where: Path, size: str) -> None:
    import subprocess

    subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)
