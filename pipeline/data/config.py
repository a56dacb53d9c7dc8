"""Typed, frozen configuration per stage. Validation collects every problem and raises one ConfigError."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pipeline.errors import ConfigError, PipelineError
from pipeline.fields import Argument, Default, FilePath, Flag, Hidden, Parsed, Range, Size, Tokens, field_problems

MAX_RECORD_BYTES = 256 * 10**6
"""A JSON line is parsed whole; a longer one is a bad record (`--max-record-bytes`; callers that take no option)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizeConfig:
    """`pipeline tokenize`: each field is an option of the command (pipeline.fields)."""

    inputs: Annotated[tuple[str, ...], Argument(), FilePath()]
    """Files, directories or globs of .jsonl/.txt/.parquet (optionally .gz/.zst) or save_to_disk folders."""
    output_prefix: Annotated[str, FilePath(), Parsed("output_prefix")]
    """Writes PREFIX.bin, PREFIX.idx and PREFIX.manifest.json (and PREFIX.tokenizer.model when training one)."""
    tokenizer: Annotated[str | None, FilePath()] = None
    """An existing sentencepiece .model file or a Hugging Face folder."""
    train_tokenizer: bool = False
    """Train a sentencepiece tokenizer on a sample of the inputs (PREFIX.tokenizer.model)."""
    vocab_size: Annotated[int, Range(300, 1_000_000)] = 32000
    """Pieces of the trained tokenizer (byte fallback needs 260 or more)."""
    model_type: Literal["bpe", "unigram"] = "bpe"
    """The sentencepiece algorithm of the trained tokenizer."""
    sample_docs: Annotated[int, Range(1)] = 100_000
    """Documents sampled (seeded) to train the tokenizer on."""
    seed: int = 1234
    """Seeds every random choice (samples, shuffles); the same seed and input give the same output."""
    text_key: str = "text"
    """JSON field / parquet column holding the text."""
    workers: Annotated[int, Range(1, 512)] = 1
    """Encoding processes; the output is identical for any count."""
    append_eos: bool = True
    """End each document with </s>."""
    on_error: Literal["skip", "fail"] = "skip"
    """skip: count bad records and go on; fail: stop at the first (exit 2)."""
    progress: Annotated[bool | None, Hidden()] = None
    """None: a progress bar only when stderr is a terminal."""
    max_record_bytes: Annotated[int, Size("256MB"), Range(1)] = MAX_RECORD_BYTES
    """A JSON line is parsed whole; a longer one is a bad record (--on-error applies). .txt files and long texts are
    read and encoded in pieces whatever their size."""
    piece_chars: Annotated[int, Hidden(), Range(1)] = 1 << 20
    """A document longer than this is encoded in pieces of about this many characters (pipeline.data.pieces)."""

    def __post_init__(self) -> None:
        problems = field_problems(self)
        if not self.inputs:
            problems.append("INPUT: give at least one file, directory or glob")
        if self.train_tokenizer == (self.tokenizer is not None):
            problems.append("give exactly one of --tokenizer PATH or --train-tokenizer")
        if problems:
            raise ConfigError(problems, "tokenize options")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardConfig:
    """`pipeline shard`: each field but the parsed sources is an option of the command (pipeline.fields)."""

    sources: Annotated[tuple[tuple[str, float], ...], Hidden()]
    """(tokenize output prefix, blend weight) pairs, from the command's PREFIX[:WEIGHT] arguments."""
    output: Annotated[str, FilePath()]
    """Folder for the shards and manifest.json."""
    seq_len: Annotated[int, Tokens(8, 2**20)]
    """Tokens per sample, e.g. 4096 or 32k (each stores seq_len + 1 for the labels)."""
    split: Annotated[tuple[float, float, float], Parsed("ratios", "98,1,1")] = (98.0, 1.0, 1.0)
    """train,val,test ratios, by document; normalised to sum 1."""
    seed: int = 1234
    """Seeds every random choice (samples, shuffles); the same seed and input give the same output."""
    num_shards: Annotated[int | None, Range(1)] = None
    """Shards per split (default: by --shard-size)."""
    shard_size_bytes: Annotated[int, Flag("shard-size"), Size("512MB"), Range(1)] = 512 * 10**6
    """Target bytes per shard."""
    cross_document: bool = True
    """--no-cross-document: never let a sample cross a document boundary (pad, and mask the padding out)."""
    whole_documents: bool = False
    """Keep each document of up to seq_len tokens whole, several to a sample, padded; training masks attention and
    the loss at their boundaries (for long-context runs). Implies --no-cross-document."""
    length_mix: Annotated[tuple[tuple[int, float], ...], Parsed("length_mix")] = ()
    """LENGTH:WEIGHT,...: draw the train split's documents at least LENGTH tokens long WEIGHT times as often for
    their share (e.g. 8k:2,32k:4 upsamples long documents for a context extension)."""
    overwrite: bool = False
    """Replace shards made with other arguments."""
    progress: Annotated[bool | None, Hidden()] = None
    """None: a progress bar only when stderr is a terminal."""
    weights_given: Annotated[bool, Hidden()] = field(default=False)
    """A weight was given with a source (PREFIX:WEIGHT)."""

    def __post_init__(self) -> None:
        problems = field_problems(self)
        if not self.sources:
            problems.append("PREFIX: give at least one output of `pipeline tokenize`")
        for prefix, w in self.sources:
            if not w > 0:
                problems.append(f"{prefix}:{w}: a blend weight must be positive")
        if len(self.split) != 3 or any(r < 0 for r in self.split) or sum(self.split) <= 0 or self.split[0] <= 0:
            problems.append(
                f"--split {','.join(map(str, self.split))}: expected three non-negative ratios "
                "train,val,test with train > 0, e.g. 98,1,1"
            )
        if self.whole_documents and self.cross_document:
            problems.append("--whole-documents keeps documents apart: it cannot be combined with --cross-document")
        edges = [e for e, _ in self.length_mix]
        if edges != sorted(set(edges)) or any(e < 2 for e in edges) or any(not w > 0 for _, w in self.length_mix):
            problems.append(
                "--length-mix: expected LENGTH:WEIGHT pairs with increasing lengths of 2 or more tokens and positive "
                "weights, e.g. 8192:2,32768:4"
            )
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
    """`pipeline curate`'s options but its inputs and output: each field is an option of the command."""

    exact: bool = True
    """Remove exact duplicates: the same text after datatrove's normalisation (case, whitespace, punctuation)."""
    near: bool = True
    """Remove near duplicates: MinHash LSH over word n-grams."""
    quality: bool = True
    """Gopher repetition and quality, C4 and FineWeb line rules (datatrove's defaults)."""
    decontaminate: Annotated[tuple[str, ...], FilePath()] = ()
    """An evaluation file or folder (what tokenize reads), repeatable: a training document sharing a
    --decontaminate-ngrams word n-gram with it is removed."""
    near_threshold: Annotated[float, Range(0.0, 1.0, open_low=True, open_high=True)] = 0.3
    """Jaccard similarity of two documents' word n-gram sets at which LSH finds them half the time (lower removes
    more); well above it almost always, well below almost never. 0.3 with 3-grams and 120 permutations (40 bands of
    3): a copy with 10% of its words edited (similarity about 0.57, at least 0.46) is found 98-100% of the time, one
    with 20% edited (about 0.35) 80%, documents sharing a fifth of their 3-grams 27%."""
    permutations: Annotated[int, Range(2)] = 120
    """MinHash hashes per document, split into LSH buckets (bands) x rows (`lsh_shape`)."""
    ngrams: Annotated[int, Range(1)] = 3
    """Words per shingle for near duplicates."""
    decontaminate_ngrams: Annotated[int, Range(1)] = 13
    """Words per n-gram shared with evaluation text."""
    text_key: str = "text"
    """JSON field / parquet column holding the text."""
    workers: Annotated[int, Range(1, 512), Default("this machine's cores")] = field(
        default_factory=lambda: os.cpu_count() or 1
    )
    """Tasks run at once."""
    seed: int = 1
    """Seeds the MinHash permutations; the same input and options keep the same documents."""

    def problems(self) -> list[str]:
        return field_problems(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class VocabConfig:
    """`pipeline extend-vocab` (pipeline.data.vocab): each field is an argument or option of the command."""

    model_dir: Annotated[str, Argument(), FilePath()]
    """The Hugging Face model folder whose tokenizer and embeddings are extended."""
    inputs: Annotated[tuple[str, ...], Argument(), FilePath()]
    """The new corpus: files, folders or globs (what tokenize reads)."""
    output: Annotated[str, FilePath()]
    """Folder for the model with the extended tokenizer (a new folder)."""
    new_tokens: Annotated[int, Range(1, 1_000_000)] = 8000
    """Pieces to add at most (fewer when the corpus supports fewer that the tokenizer lacks)."""
    sample_docs: Annotated[int, Range(1)] = 100_000
    """Documents sampled (seeded) to find the pieces."""
    held_out_docs: Annotated[int, Range(1)] = 200
    """Documents kept out of the sentencepiece training, on which bytes per token are measured."""
    seed: int = 1234
    """Seeds every random choice (samples, shuffles); the same seed and input give the same output."""
    text_key: str = "text"
    """JSON field / parquet column holding the text."""

    def __post_init__(self) -> None:
        problems = field_problems(self)
        if not self.inputs:
            problems.append("INPUT: give at least one file, folder or glob of the new corpus")
        if problems:
            raise PipelineError("; ".join(problems))
