"""Typed, frozen configuration per stage. Validation collects every problem and raises one ConfigError."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import ConfigError, PipelineError


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizeConfig:
    inputs: tuple[str, ...]
    """Files, directories or globs of .jsonl/.txt/.parquet (optionally .gz/.zst) or save_to_disk folders."""
    output_prefix: str
    """Writes PREFIX.bin, PREFIX.idx, PREFIX.manifest.json (and PREFIX.tokenizer.model when training)."""
    tokenizer: str | None = None
    """An existing sentencepiece .model or a local Hugging Face tokenizer folder."""
    train_tokenizer: bool = False
    """Train a sentencepiece model on a sample of the input documents."""
    vocab_size: int = 32000
    model_type: str = "bpe"
    sample_docs: int = 100_000
    """How many documents (a seeded reservoir sample) the tokenizer is trained on."""
    seed: int = 1234
    text_key: str = "text"
    workers: int = 1
    append_eos: bool = True
    on_error: str = "skip"
    """skip: count and report bad records; fail: stop at the first one (exit code 2)."""
    progress: bool | None = None
    """None: a progress bar only when stderr is a terminal."""
    max_record_bytes: int = 256 << 20
    """A JSON line is parsed whole: a longer one is a bad record (--on-error applies)."""
    piece_chars: int = 1 << 20
    """A document longer than this is encoded in pieces of about this many characters (pipeline.data.pieces)."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_record_bytes < 1 or self.piece_chars < 1:
            problems.append("--max-record-bytes and the piece size must be positive")
        if not self.inputs:
            problems.append("INPUT: give at least one file, directory or glob")
        if self.train_tokenizer == (self.tokenizer is not None):
            problems.append("give exactly one of --tokenizer PATH or --train-tokenizer")
        if self.train_tokenizer and not 300 <= self.vocab_size <= 1_000_000:
            problems.append(f"--vocab-size {self.vocab_size}: expected 300..1,000,000 (byte fallback needs 260+)")
        if self.model_type not in ("bpe", "unigram"):
            problems.append(f"--model-type {self.model_type}: expected bpe or unigram")
        if self.sample_docs < 1:
            problems.append(f"--sample-docs {self.sample_docs}: expected a positive count")
        if self.workers < 1:
            problems.append(f"--workers {self.workers}: expected 1 or more")
        if self.on_error not in ("skip", "fail"):
            problems.append(f"--on-error {self.on_error}: expected skip or fail")
        if problems:
            raise ConfigError(problems, "tokenize options")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardConfig:
    sources: tuple[tuple[str, float], ...]
    """(tokenize output prefix, blend weight) pairs."""
    output: str
    seq_len: int
    split: tuple[float, float, float] = (98.0, 1.0, 1.0)
    """train, val, test ratios; normalised to sum 1."""
    seed: int = 1234
    num_shards: int | None = None
    shard_size_bytes: int = 512 * 2**20
    cross_document: bool = True
    """False: no sample crosses a document boundary (padding + loss mask)."""
    whole_documents: bool = False
    """Documents up to seq_len + 1 tokens whole, several to a sample (best fit), padded; training masks attention
    and the loss at the boundaries between them (pipeline.data.packing.pack_whole). Needs cross_document False."""
    length_mix: tuple[tuple[int, float], ...] = ()
    """(shortest length in tokens, weight) per length bucket, ascending: the train split's documents at least that
    long are drawn `weight` times as often for their share (shorter than the first edge: weight 1)."""
    overwrite: bool = False
    progress: bool | None = None
    weights_given: bool = field(default=False)

    def __post_init__(self) -> None:
        problems = []
        if not self.sources:
            problems.append("PREFIX: give at least one output of `pipeline tokenize`")
        for prefix, w in self.sources:
            if not w > 0:
                problems.append(f"{prefix}:{w}: a blend weight must be positive")
        if self.seq_len < 8:
            problems.append(f"--seq-len {self.seq_len}: expected 8 or more")
        if len(self.split) != 3 or any(r < 0 for r in self.split) or sum(self.split) <= 0 or self.split[0] <= 0:
            problems.append(
                f"--split {','.join(map(str, self.split))}: expected three non-negative ratios "
                "train,val,test with train > 0, e.g. 98,1,1"
            )
        if self.num_shards is not None and self.num_shards < 1:
            problems.append(f"--num-shards {self.num_shards}: expected 1 or more")
        if self.whole_documents and self.cross_document:
            problems.append("--whole-documents keeps documents apart: it cannot be combined with --cross-document")
        edges = [e for e, _ in self.length_mix]
        if edges != sorted(set(edges)) or any(e < 2 for e in edges) or any(not w > 0 for _, w in self.length_mix):
            problems.append(
                "--length-mix: expected LENGTH:WEIGHT pairs with increasing lengths of 2 or more tokens and positive "
                "weights, e.g. 8192:2,32768:4"
            )
        if self.shard_size_bytes < 1:
            problems.append("--shard-size: expected a positive size such as 512MB")
        if problems:
            raise ConfigError(problems, "shard options")


def parse_sources(specs: tuple[str, ...]) -> tuple[tuple[tuple[str, float], ...], bool]:
    """`pipeline shard`'s PREFIX[:WEIGHT] arguments as (prefix, weight) pairs (weight 1 where none is given), and
    whether any weight was given. A colon followed by something other than a number is part of the path, unless
    the part before it is a tokenize output (then the weight is a typo); a shard folder is refused naming it."""
    out, given = [], False
    for spec in specs:
        prefix, sep, weight = spec.rpartition(":")
        if sep and prefix and not weight.replace(".", "", 1).isdigit():
            if not Path(spec + ".manifest.json").exists() and Path(prefix + ".manifest.json").exists():
                raise PipelineError(
                    f"{spec}: the weight '{weight}' after ':' is not a number; give PREFIX:WEIGHT such as {prefix}:2"
                )
            prefix, sep = spec, ""
        if not sep or not prefix:
            prefix = spec
        if (Path(prefix) / "manifest.json").exists() and not Path(prefix + ".manifest.json").exists():
            raise PipelineError(
                f"{prefix}: a shard folder (`pipeline shard`'s output); give the tokenize prefix it was made from: "
                "the PREFIX of PREFIX.bin, PREFIX.idx and PREFIX.manifest.json"
            )
        if sep and prefix != spec:
            out.append((prefix, float(weight)))
            given = True
        else:
            out.append((spec, 1.0))
    firsts: dict[str, str] = {}
    for prefix, _ in out:
        key = os.path.realpath(prefix + ".manifest.json")
        if key in firsts:
            raise PipelineError(
                f"{firsts[key]} and {prefix} are the same tokenize output: it would be blended twice; give it once, "
                f"with a weight to draw more of it (e.g. {prefix}:2)"
            )
        firsts[key] = prefix
    return tuple(out), given


@dataclass(frozen=True, kw_only=True)
class CurateOptions:
    exact: bool = True
    """Remove exact duplicates: the same text after datatrove's normalisation (case, whitespace, punctuation)."""
    near: bool = True
    """Remove near duplicates: MinHash LSH over word n-grams."""
    quality: bool = True
    """Gopher repetition and quality, C4 and FineWeb line rules (datatrove's defaults)."""
    decontaminate: tuple[str, ...] = ()
    """Evaluation files (what tokenize reads): a training document sharing an n-gram with any is removed."""
    near_threshold: float = 0.3
    """Jaccard similarity of two documents' word n-gram sets at which LSH finds them half the time; well above it
    almost always, well below almost never. 0.3 with 3-grams and 120 permutations (40 bands of 3): a copy with 10%
    of its words edited (similarity about 0.57, at least 0.46) is found 98-100% of the time, one with 20% edited
    (about 0.35) 80%, documents sharing a fifth of their 3-grams 27%."""
    permutations: int = 120
    """MinHash hashes per document, split into LSH buckets (bands) x rows (`lsh_shape`)."""
    ngrams: int = 3
    """Words per shingle for near-duplicate detection."""
    decontaminate_ngrams: int = 13
    text_key: str = "text"
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    seed: int = 1

    def problems(self) -> list[str]:
        p = []
        if not 0.0 < self.near_threshold < 1.0:
            p.append(f"--near-threshold {self.near_threshold}: a Jaccard similarity between 0 and 1 (e.g. 0.3)")
        if self.permutations < 2:
            p.append(f"--permutations {self.permutations}: at least 2 (e.g. 120)")
        if self.ngrams < 1 or self.decontaminate_ngrams < 1:
            p.append("--ngrams and --decontaminate-ngrams: at least 1 word")
        if self.workers < 1:
            p.append(f"--workers {self.workers}: at least 1")
        return p
