"""Stage 2 (pipeline.data.shard): the shard folder, its manifest, reruns, blends, mixed tokenizers refused,
permissions, splits too small said. The pure split and pack functions are tests/unit/data/test_packing.py's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.data import shard as shard_stage
from pipeline.data import tokenize as tokenizing
from pipeline.data.config import TokenizeConfig
from pipeline.data.indexed import IndexedReader
from pipeline.data.loader import ShardedDataset
from pipeline.data.packing import blend_counts
from pipeline.errors import PipelineError
from tests.conftest import CORPUS, bench_module, shard_into, tokenize_with, tokenizer_model


def test_shard_outputs_manifest_and_reader(shards: Path, tokenized: Path) -> None:
    m = json.loads((shards / "manifest.json").read_text())
    assert m["seq_len"] == 64 and len(m["fingerprint"]) == 16
    tok_docs = IndexedReader(tokenized)
    assert sum(m["splits"][s]["documents"] for s in ("train", "val", "test")) == len(tok_docs)
    for split in ("train", "val", "test"):
        dataset = ShardedDataset(shards, split)
        s = m["splits"][split]
        assert len(dataset) == s["samples"] > 0
        assert s["input_tokens"] == s["samples"] * 65 + s["dropped_tokens"]
        assert dataset[0].shape == (65,) and dataset.loss_mask(0) is None
    assert (shards / "tokenizer.model").exists()
    text = shard_stage.describe(shards)
    assert "train:" in text and "fingerprint" in text


def test_rerun_is_a_noop_and_other_args_are_refused(shards: Path, tokenized: Path, tmp_path: Path) -> None:
    out = tmp_path / "s"
    shard_into([(tokenized, 1.0)], out, seq_len=32, split=(80.0, 10.0, 10.0))
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = shard_into([(tokenized, 1.0)], out, seq_len=32, split=(80.0, 10.0, 10.0))
    assert again.skipped and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(PipelineError, match="pass --overwrite"):
        shard_into([(tokenized, 1.0)], out, seq_len=48, split=(80.0, 10.0, 10.0))
    res = shard_into([(tokenized, 1.0)], out, seq_len=48, split=(80.0, 10.0, 10.0), overwrite=True)
    assert res.manifest["seq_len"] == 48 and res.manifest["fingerprint"] != again.manifest["fingerprint"]
    assert not list(out.glob(".tmp-*"))


def test_mixed_tokenizers_are_refused(tokenized: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    tokenizing.run(
        TokenizeConfig(
            inputs=(str(CORPUS),), output_prefix=str(other), train_tokenizer=True, vocab_size=700, progress=False
        )
    )
    with pytest.raises(PipelineError, match="different tokenizers"):
        shard_into([(tokenized, 1.0), (other, 1.0)], tmp_path / "mix", seq_len=32)


def test_blend_draws_in_proportion_and_repeats_small_sources(tokenized: Path, tmp_path: Path) -> None:
    lines = CORPUS.read_text().splitlines(keepends=True)
    model = str(tokenized) + ".tokenizer.model"
    for name, part in (("big", lines[:12] * 3), ("small", lines[12:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(part))
        tokenizing.run(
            TokenizeConfig(
                inputs=(str(tmp_path / f"{name}.jsonl"),),
                output_prefix=str(tmp_path / name),
                tokenizer=model,
                progress=False,
            )
        )
    res = shard_into(
        [(tmp_path / "big", 0.5), (tmp_path / "small", 0.5)],
        tmp_path / "blend",
        seq_len=32,
        split=(100.0, 0.0, 0.0),
        weights_given=True,
    )
    srcs = res.manifest["splits"]["train"]["sources"]
    drawn = [s["drawn_samples"] for s in srcs]
    assert abs(drawn[0] / sum(drawn) - 0.5) < 0.01
    assert srcs[1]["effective_epochs"] > 1.5 and srcs[0]["effective_epochs"] < 1.0
    assert blend_counts([100, 10], [0.7, 0.3]) == [77, 33]
    assert blend_counts([100, 10], None) == [100, 10]


def test_each_sample_records_its_source_and_a_changed_record_is_refused(two_sources: Path) -> None:
    """Every shard keeps each sample's source (the index of its `pipeline shard` input) beside it: in each split
    as many samples of each source as the manifest says were drawn, each sample's tokens among its source's, and
    a record altered after sharding fails the checksum."""
    for split in ("train", "val", "test"):
        ds = ShardedDataset(two_sources, split)
        assert ds.source_names == ["first", "second"]
        of = ds.sources_of(list(range(len(ds))))
        assert of is not None
        drawn = [s["drawn_samples"] for s in ds.manifest["splits"][split]["sources"]]
        assert np.bincount(of, minlength=2).tolist() == drawn and min(drawn) > 0, (split, drawn)
    # a sample's first tokens occur in its own source's tokens (the two halves of the corpus differ)
    train = ShardedDataset(two_sources, "train")
    readers = [IndexedReader(two_sources.parent / name) for name in ("first", "second")]
    streams = [np.concatenate([r[i] for i in range(len(r))]).tobytes() for r in readers]
    eos, checked = train.eos_id, 0
    for i in range(len(train)):
        row = train[i]
        head = row[: int(np.argmax(row == eos)) if (row == eos).any() else len(row)]  # within one document
        if len(head) < 8:
            continue
        src = int(train.sources_of([i])[0])  # type: ignore[index]
        assert head.astype(readers[0].dtype).tobytes() in streams[src], i
        checked += 1
    assert checked > 20
    shard = next(two_sources.glob("val-*.src"))
    record = bytearray(shard.read_bytes())
    record[0] ^= 1
    shard.write_bytes(bytes(record))
    try:
        with pytest.raises(PipelineError, match=r"val-00000\.src: checksum differs from the manifest"):
            ShardedDataset(two_sources, "val").verify()
    finally:
        record[0] ^= 1
        shard.write_bytes(bytes(record))


def test_a_split_without_validation_is_said(tokenized: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        res = shard_into([(tokenized, 1.0)], tmp_path / "s", seq_len=32, split=(100.0, 0.0, 0.0))
    assert res.manifest["splits"]["val"]["samples"] == 0
    assert "--split 100,0,0 leaves no validation split: training will run without validation" in caplog.text


def test_outputs_are_readable_by_the_group_as_the_umask_says(tokenized: Path, tmp_path: Path) -> None:
    """Runs and data often live on a shared mount: tokenize, shard and their manifests come out with a plain
    file's permissions (0644 under umask 022), not the owner-only 0600 of a temporary file."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        tok = tmp_path / "t"
        tokenizing.run(
            TokenizeConfig(
                inputs=(str(CORPUS),),
                output_prefix=str(tok),
                tokenizer=str(tokenized) + ".tokenizer.model",
                progress=False,
            )
        )
        out = tmp_path / "s"
        shard_into([(tok, 1.0)], out, seq_len=32, split=(80.0, 10.0, 10.0))
    finally:
        os.umask(old)
    made = [*tmp_path.glob("t.*"), out, *out.iterdir()]
    assert made and all(p.stat().st_mode & (stat.S_IRGRP | stat.S_IROTH) for p in made), [
        (p.name, oct(p.stat().st_mode)) for p in made
    ]


def test_a_held_out_split_too_small_to_compare_checkpoints_is_said(
    tokenized: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        res = shard_into([(tokenized, 1.0)], tmp_path / "s", seq_len=512, split=(98.0, 1.0, 1.0))
    val = res.manifest["splits"]["val"]["samples"]
    assert 0 < val < 32 and f"the val split has only {val} samples" in caplog.text
    assert "larger --split share than 98,1,1 (e.g. 96,2,2)" in caplog.text
    # already 90,5,5 (newcomer trial 4): the suggestion is larger than what was given, never the same
    caplog.clear()
    with caplog.at_level("WARNING"):
        shard_into([(tokenized, 1.0)], tmp_path / "t", seq_len=2048, split=(90.0, 5.0, 5.0))
    assert "e.g. 90,5,5" not in caplog.text
    assert "larger --split share than 90,5,5 (e.g. 80,10,10)" in caplog.text or "split has 0 samples" in caplog.text


def test_split_ratios_may_be_written_as_percentages(tokenized: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from pipeline.cli import main

    args = [str(tokenized), "--seq-len", "64", "--split"]
    r = CliRunner().invoke(main, ["shard", *args, "90%,5%,5%", "--output", str(tmp_path / "pct")])
    assert r.exit_code == 0, r.output
    plain = CliRunner().invoke(main, ["shard", *args, "90,5,5", "--output", str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output
    got = [json.loads((tmp_path / d / "manifest.json").read_text())["splits"] for d in ("pct", "plain")]
    assert got[0] == got[1]


def test_tokenized_files_changed_after_tokenizing_are_refused(tokenized: Path, tmp_path: Path) -> None:
    """A .bin or .idx replaced, cut short or edited after `pipeline tokenize` wrote it is still readable; shard
    checks it against the sizes and sha256 the manifest recorded, and names the file."""
    import shutil

    def copy() -> Path:
        prefix = tmp_path / f"copy{len(list(tmp_path.iterdir()))}" / "corpus"
        prefix.parent.mkdir()
        for ext in (".bin", ".idx", ".manifest.json", ".tokenizer.model"):
            shutil.copy(str(tokenized) + ext, str(prefix) + ext)
        return prefix

    files = json.loads(Path(str(tokenized) + ".manifest.json").read_text())["files"]
    assert files["bin"]["bytes"] == Path(str(tokenized) + ".bin").stat().st_size
    assert files["bin"]["sha256"] == shard_stage.sha256_file(str(tokenized) + ".bin")

    cut = copy()
    with open(str(cut) + ".bin", "r+b") as f:
        f.truncate(files["bin"]["bytes"] - 2)
    with pytest.raises(PipelineError, match=rf"corpus\.bin: {files['bin']['bytes'] - 2:,} bytes, but .* wrote"):
        shard_into([(cut, 1.0)], tmp_path / "s1", seq_len=32)

    edited = copy()
    data = bytearray(Path(str(edited) + ".bin").read_bytes())
    data[10] ^= 0xFF  # same size, other tokens
    Path(str(edited) + ".bin").write_bytes(bytes(data))
    with pytest.raises(PipelineError, match=r"corpus\.bin: its content differs .* re-run `pipeline tokenize`"):
        shard_into([(edited, 1.0)], tmp_path / "s2", seq_len=32)

    gone = copy()
    Path(str(gone) + ".idx").unlink()
    with pytest.raises(PipelineError, match=r"corpus\.idx: missing, though .*manifest\.json lists it"):
        shard_into([(gone, 1.0)], tmp_path / "s3", seq_len=32)
    assert not (tmp_path / "s1").exists() and not (tmp_path / "s2").exists()

    older = copy()  # a manifest from before the files were recorded still shards
    manifest = json.loads(Path(str(older) + ".manifest.json").read_text())
    del manifest["files"], manifest["sealed_sha256"]  # nor sealed
    Path(str(older) + ".manifest.json").write_text(json.dumps(manifest))
    assert shard_into([(older, 1.0)], tmp_path / "s4", seq_len=32).manifest["seq_len"] == 32


def test_a_16k_token_document_survives_tokenize_shard_and_loader_whole(tokenized: Path, tmp_path: Path) -> None:
    """Long context: a document of 16K tokens, sharded at seq_len 16384 with each document on its own
    (--no-cross-document), reaches the loader as one sample holding every one of its tokens in order, its end of
    sequence included, then padding only."""
    from pipeline.data.loader import build_loader
    from pipeline.data.tokenizer import Tokenizer

    tok = Tokenizer(str(tokenizer_model(tokenized)))
    plays = "\n".join(json.loads(line)["text"] for line in CORPUS.read_text().splitlines())
    text = tok.decode(tok.encode(plays)[:16000])  # about 16K tokens of text, cut where the tokenizer cuts
    source = tmp_path / "doc16k.jsonl"
    source.write_text(json.dumps({"text": text}) + "\n")
    tokenize_with(tmp_path / "doc16k", [str(source)], tokenizer_model(tokenized))
    whole = IndexedReader(tmp_path / "doc16k")[0].tolist()  # its ids as tokenize wrote them, the EOS last
    assert 15_900 <= len(whole) <= 16_385 and whole[-1] == tok.eos_id
    out = tmp_path / "shards"
    shard_into([(tmp_path / "doc16k", 1.0)], out, seq_len=16384, split=(100.0, 0.0, 0.0), cross_document=False)
    data = ShardedDataset(out, "train")
    assert len(data) == 1
    loader = build_loader(data, seed=1, micro_batch_size=1, data_parallel_size=1, rank=0, num_workers=0)
    batch = next(iter(loader))
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    assert ids[: len(whole)] == whole[: len(ids)] and labels[: len(whole) - 1] == whole[1:]
    assert all(y == -100 for y in labels[len(whole) - 1 :])  # the padding after it carries no loss


def varied_corpus(tokenized: Path, tmp_path: Path, docs: int = 240, longest: int = 60) -> Path:
    """A tokenized corpus of `docs` documents of 3 to `longest` words (seeded) cut from the fixture's text."""
    rng = np.random.default_rng(7)
    words = " ".join(json.loads(line)["text"] for line in CORPUS.read_text().splitlines()).split()
    source = tmp_path / "varied.jsonl"
    with source.open("w") as f:
        for _ in range(docs):
            n, at = int(rng.integers(3, longest)), int(rng.integers(0, len(words) - longest))
            f.write(json.dumps({"text": " ".join(words[at : at + n])}) + "\n")
    tokenize_with(tmp_path / "varied", [str(source)], tokenizer_model(tokenized))
    return tmp_path / "varied"


def test_whole_documents_reach_the_loader_whole_with_positions_that_restart(tokenized: Path, tmp_path: Path) -> None:
    """--whole-documents: each train document is in exactly one sample, contiguous, several to a sample; the
    loader's positions restart at 0 after every EOS (so attention stays inside a document), an EOS predicts
    nothing, and every other token of every document is a label once."""
    from pipeline.data.loader import collate_samples
    from pipeline.data.packing import split_documents

    prefix = varied_corpus(tokenized, tmp_path)
    out = tmp_path / "whole"
    shard_into([(prefix, 1.0)], out, seq_len=256, split=(90.0, 5.0, 5.0), cross_document=False, whole_documents=True)
    data = ShardedDataset(out, "train")
    assert data.document_masks and "whole documents" in shard_stage.describe(out)
    reader = IndexedReader(prefix)
    docs = [reader[int(d)].tolist() for d in split_documents(len(reader), (90.0, 5.0, 5.0), 1234, 0)["train"]]
    assert max(map(len, docs)) <= 257 and len(data) < len(docs) / 2, "several documents share a sample"
    rows = [data[i].tolist() for i in range(len(data))]
    for doc in docs:
        assert any(r[k : k + len(doc)] == doc for r in rows for k in range(len(r) - len(doc) + 1))
    batch = collate_samples(data, list(range(len(data))))
    eos = data.eos_id
    for ids, labels, pos in zip(batch["input_ids"], batch["labels"], batch["position_ids"], strict=True):
        assert pos[0] == 0
        for k in range(1, len(ids)):
            assert pos[k] == (0 if ids[k - 1] == eos else pos[k - 1] + 1)
        assert (labels[ids == eos] == -100).all()
    assert int((batch["labels"] != -100).sum()) == sum(len(d) - 1 for d in docs)


def test_length_mix_draws_long_documents_by_their_weight_and_is_seeded(tokenized: Path, tmp_path: Path) -> None:
    """--length-mix: the train split's documents of each bucket are packed apart and drawn in proportion to
    available x weight, the split's total kept; the same seed writes the same shards; val/test are untouched."""
    prefix = varied_corpus(tokenized, tmp_path)
    edge = int(np.median(IndexedReader(prefix).lengths))
    kw = {"seq_len": 128, "cross_document": False, "whole_documents": True, "split": (90.0, 5.0, 5.0)}
    plain = shard_into([(prefix, 1.0)], tmp_path / "plain", **kw).manifest
    mixed = shard_into([(prefix, 1.0)], tmp_path / "mixed", length_mix=((edge, 3.0),), **kw).manifest
    buckets = mixed["splits"]["train"]["sources"][0]["length_buckets"]
    assert [b["from_tokens"] for b in buckets] == [0, edge] and [b["weight"] for b in buckets] == [1.0, 3.0]
    short, long = buckets
    total = short["available_samples"] + 3 * long["available_samples"]
    n = mixed["splits"]["train"]["samples"]
    assert n == short["available_samples"] + long["available_samples"] == short["drawn_samples"] + long["drawn_samples"]
    assert abs(long["drawn_samples"] - n * 3 * long["available_samples"] / total) < 1
    rates = [b["drawn_samples"] / b["available_samples"] for b in (short, long)]
    assert rates[0] < 1 < rates[1] and abs(rates[1] / rates[0] - 3) < 0.2, rates  # a long sample 3x as often
    for split in ("val", "test"):
        assert mixed["splits"][split]["samples"] == plain["splits"][split]["samples"]
    again = shard_into([(prefix, 1.0)], tmp_path / "again", length_mix=((edge, 3.0),), **kw).manifest
    shas = [[f["sha256"] for f in m["splits"]["train"]["shards"]] for m in (mixed, again)]
    assert shas[0] == shas[1]
    assert f"documents of {edge:,}+ tokens (x3)" in shard_stage.describe(tmp_path / "mixed")


@pytest.mark.parametrize(
    "spec, says",
    [
        ("8k", "has no weight"),
        ("eight:2", "is not LENGTH:WEIGHT"),
        ("8k:2,4k:1", "increasing lengths"),
        ("8k:0", "positive"),
    ],
)
def test_a_bad_length_mix_is_one_line_naming_it(tokenized: Path, tmp_path: Path, spec: str, says: str) -> None:
    from click.testing import CliRunner

    from pipeline.cli import main

    args = ["shard", str(tokenized), "--output", str(tmp_path / "o"), "--seq-len", "64", "--length-mix", spec]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and says in result.output and "--length-mix" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "o" / "manifest.json").exists()


def test_whole_documents_need_documents_that_end_with_eos(tokenized: Path, tmp_path: Path) -> None:
    tokenize_with(tmp_path / "plain", [str(CORPUS)], tokenizer_model(tokenized), append_eos=False)
    with pytest.raises(PipelineError, match="append_eos false"):
        shard_into([(tmp_path / "plain", 1.0)], tmp_path / "o", seq_len=64, cross_document=False, whole_documents=True)


def test_whole_documents_with_an_explicit_cross_document_is_refused(tokenized: Path, tmp_path: Path) -> None:
    """Two flags that ask for opposite samples: refused in one line before anything is written (the default of
    --cross-document stays implied off by --whole-documents)."""
    from click.testing import CliRunner

    from pipeline.cli import main

    args = ["shard", str(tokenized), "--output", str(tmp_path / "o"), "--seq-len", "64", "--whole-documents"]
    r = CliRunner().invoke(main, [*args, "--cross-document"])
    assert r.exit_code == 2 and "--whole-documents and --cross-document" in r.output, r.output
    assert not (tmp_path / "o").exists()


def test_shard_counts_held_out_documents_that_are_near_duplicates_of_training_ones(
    tokenized: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A corpus with copies of some documents (a few words edited, or none) split by document: copies that fell
    in val or test beside their original in train are counted, said in one warning naming `pipeline curate`, and
    kept in the manifest; the same corpus without the copies counts none."""
    import logging

    bench = bench_module("curate_bench")
    corpus = tmp_path / "copies.jsonl"
    truth = bench.synthetic_corpus(corpus, 300, (0.02,))  # 30 originals with an edited and an exact copy each
    rows = [json.loads(line) for line in corpus.read_text().splitlines()]
    copies = {i for c in truth["clusters"] for i in c[1:]}
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(json.dumps(r) + "\n" for r in rows if r["id"] not in copies))
    model = tokenizer_model(tokenized)
    counted = {}
    for name in ("copies", "clean"):
        tokenize_with(tmp_path / name, [str(tmp_path / f"{name}.jsonl")], model)
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            res = shard_into(
                [(tmp_path / name, 1.0)], tmp_path / f"{name}-shards", seq_len=64, split=(60.0, 20.0, 20.0)
            )
        leak = res.manifest["leak_check"]
        counted[name] = sum(leak["near_duplicates_of_train"].values())
        warned = [r.getMessage() for r in caplog.records if "near duplicates of training" in r.getMessage()]
        assert bool(warned) == bool(counted[name]) and all("pipeline curate" in w for w in warned)
        assert leak["train_checked"] == leak["train_documents"] == res.manifest["splits"]["train"]["documents"]
    assert counted["clean"] == 0
    assert counted["copies"] >= 20  # of about 30 held-out cluster members with a sibling in train (32 here)
    assert "near duplicates of train documents:" in shard_stage.describe(tmp_path / "copies-shards")
