"""Shared fixtures: a real sentencepiece tokenizer trained on the fixture corpus, and real shards built from it."""

from __future__ import annotations

import os
from pathlib import Path

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


STEPS = 20


@pytest.fixture(scope="session")
def zero_runs(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """One 20-step 2-rank run per ZeRO stage (fp32) through the deepspeed launcher, shared by several tests."""
    from tests.multiproc import launch

    runs = {}
    base = tmp_path_factory.mktemp("zero")
    for stage in (1, 2, 3):
        run_dir = base / f"zero{stage}"
        cfg = launch.write_config(
            base / f"zero{stage}.yaml", run_dir=run_dir, shards=shards, ds_config=f"zero{stage}.json", steps=STEPS
        )
        out = launch.run(cfg)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        runs[stage] = run_dir
    return runs
