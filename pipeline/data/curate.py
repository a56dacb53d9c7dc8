"""`pipeline curate`: stage 0, before tokenize. Exact and near-duplicate removal, the usual quality heuristics and
decontamination against evaluation text, as a pipeline of Hugging Face datatrove's steps (its readers' document
model, its Gopher/C4/FineWeb filters, its exact-hash and MinHash-LSH dedup stages, its n-gram decontamination
filter), run by its local executor on this machine's cores. We add the front (our readers: what tokenize reads,
every bad record counted with its file and line) and the back (one report, one output folder written whole).

Stages, each a datatrove executor run over `workers` tasks:
  read        our readers -> documents (id = file:line, the record's other fields kept as metadata)
  filter      quality filters, then decontamination, each writing what it removed
  exact 1-3   a hash of each normalised text; duplicates found; all but one of each removed
  near 1-4    MinHash signatures of word n-grams; LSH buckets; clusters; all but one of each removed
The output (DIR/documents/*.jsonl.gz, each record's fields at the top level) is what `pipeline tokenize` reads;
DIR/report.json says what went in, what came out and why each removed document was removed, with examples;
DIR/removed/ holds every removed document. The same input and options keep the same documents."""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.atomic import replacing_dir, write_json
from pipeline.data.readers import read_records, resolve_inputs
from pipeline.errors import PipelineError

log = logging.getLogger(__name__)
NEEDED = "pip install -e '.[curate]' (datatrove[processing] and spacy)"
EXAMPLES = 3  # removed documents shown per reason in the report
EXAMPLE_CHARS = 300


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


def lsh_shape(threshold: float, permutations: int) -> tuple[int, int]:
    """(bands, rows) with bands x rows = permutations whose LSH threshold (1 / bands) ** (1 / rows), the
    similarity found half the time, is nearest `threshold`."""
    shapes = [(permutations // r, r) for r in range(1, permutations + 1) if permutations % r == 0]
    return min(shapes, key=lambda br: abs((1 / br[0]) ** (1 / br[1]) - threshold))


def found_probability(similarity: float, bands: int, rows: int) -> float:
    """Chance LSH puts two documents of this Jaccard similarity in one bucket: 1 - (1 - s^r)^b."""
    return 1 - (1 - similarity**rows) ** bands


@dataclass
class Report:
    inputs: list[str]
    options: dict[str, Any]
    documents_in: int = 0
    bytes_in: int = 0
    documents_kept: int = 0
    bytes_kept: int = 0
    bad_records: int = 0
    removed: dict[str, dict[str, Any]] = field(default_factory=dict)
    """reason -> {documents, bytes, examples: [{id, text}]}"""
    seconds: dict[str, float] = field(default_factory=dict)

    def summary(self, out: Path) -> list[str]:
        def share(n: int) -> str:
            return f"{n / self.documents_in:.1%}" if self.documents_in else "-"

        lines = [
            f"curate: {self.documents_in:,} documents in ({self.bytes_in / 1e6:,.1f} MB), {self.documents_kept:,} "
            f"kept ({self.bytes_kept / 1e6:,.1f} MB, {share(self.documents_kept)}) in "
            f"{sum(self.seconds.values()):.0f} s"
        ]
        for reason, r in sorted(self.removed.items(), key=lambda kv: -kv[1]["documents"]):
            lines.append(f"  removed {r['documents']:>9,} ({share(r['documents'])}) {reason}")
        if self.bad_records:
            lines.append(f"  {self.bad_records:,} records could not be read (see report.json: bad_record)")
        lines.append(
            f"report: {out / 'report.json'} (examples per reason; every removed document in {out / 'removed'})"
        )
        lines.append(f"next: pipeline tokenize {out / 'documents'} --output-prefix ...")
        return lines


def curate(inputs: list[str], output: str, opts: CurateOptions, echo: Any = print) -> Report:
    """Curate `inputs` into `output` (see the module's docstring); returns the report it wrote."""
    if problems := opts.problems():
        raise PipelineError("; ".join(problems))
    sources = resolve_inputs(inputs)
    evals = resolve_inputs(list(opts.decontaminate)) if opts.decontaminate else []
    try:
        import datatrove  # noqa: F401
        import spacy  # noqa: F401  (datatrove's English word tokenizer)
    except ImportError as e:
        raise PipelineError(f"pipeline curate needs {e.name}: {NEEDED}") from None
    out = Path(output)
    if out.exists() and not (out / "report.json").exists() and any(out.iterdir()):
        raise PipelineError(f"--output {out}: a folder that is not a curate output; name an empty or new folder")
    report = Report([str(s.path) for s in sources], asdict(opts) | {"decontaminate": list(opts.decontaminate)})
    _quiet_datatrove()
    with replacing_dir(out) as work:  # written whole, replacing a previous output whole; nothing left on an error
        try:
            for name, run in _stages(sources, evals, work, opts, report):
                t0 = time.perf_counter()
                run()
                report.seconds[name] = round(time.perf_counter() - t0, 2)
                echo(f"curate: {name} done in {report.seconds[name]:.1f} s")
        except _Emptied:
            pass  # counted below: nothing read, or everything removed
        _count(work, report)
        if report.documents_in == 0:
            raise PipelineError(f"{', '.join(inputs)}: no readable document (bad records: {report.bad_records})")
        if report.documents_kept == 0:
            raise PipelineError(
                f"every one of the {report.documents_in:,} documents was removed ({', '.join(report.removed)}); "
                "turn off the step that took them (--no-quality, --no-near, ...) or lower its bar"
            )
        for scratch in SCRATCH:
            shutil.rmtree(work / scratch, ignore_errors=True)
        write_json(work / "report.json", asdict(report))
    for line in report.summary(out):
        echo(line)
    return report


def _quiet_datatrove() -> None:
    """datatrove's tasks log their progress and stats to stderr at INFO; keep them in the task log files (the
    stage's folder under .logs while it runs) and only warnings and errors on the terminal."""
    import sys

    import datatrove.executor.base as executor_base
    from datatrove.utils import logging as dt_logging

    def terminal() -> None:
        dt_logging.logger.remove()
        dt_logging.logger.add(sys.stderr, level="WARNING")

    def task_logger(logging_dir: Any, rank: int, local_rank: int = 0, node_rank: int = -1) -> Any:
        terminal()
        logfile = logging_dir.open(f"logs/task_{rank:05d}.log", "w")
        dt_logging.logger.add(logfile, level="DEBUG")
        return logfile

    def close_task_logger(logfile: Any) -> None:
        dt_logging.logger.complete()
        terminal()
        logfile.close()

    executor_base.add_task_logger = task_logger  # type: ignore[attr-defined]
    executor_base.close_task_logger = close_task_logger  # type: ignore[attr-defined]
    import functools

    import datatrove.pipeline.dedup.exact_dedup as exact_dedup
    import datatrove.pipeline.dedup.minhash as minhash
    import datatrove.pipeline.readers.base as readers_base
    import tqdm

    for module in (exact_dedup, minhash, readers_base):  # their bars, each a few lines of every stage's stderr
        module.tqdm = functools.partial(tqdm.tqdm, disable=True)  # type: ignore[attr-defined]
    dt_logging.logger.remove()
    dt_logging.logger.add(sys.stderr, level="WARNING")


def _stages(sources: list[Any], evals: list[Any], work: Path, opts: CurateOptions, report: Report) -> Iterator[Any]:
    """(name, run) per stage, in order."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    tasks = max(1, opts.workers)

    def execute(name: str, steps: list[Any], n: int = tasks, reads: str | None = None) -> Any:
        """A stage of `n` tasks; one that `reads` a folder of documents runs a task per file there, at most `n`
        (a folder left empty by the stage before ends the curation: _Emptied)."""

        def run() -> None:
            count = n
            if reads is not None:
                files = len(list((work / reads).glob("*.jsonl.gz")))
                if not files:
                    raise _Emptied(reads)
                count = min(n, files)
            LocalPipelineExecutor(
                steps,
                tasks=count,
                workers=min(count, tasks),
                logging_dir=str(work / ".logs" / name.replace(" ", "-")),
                skip_completed=False,
                start_method="fork",
            ).run()

        return name, run

    def reader(folder: str) -> Any:
        return JsonlReader(str(work / folder), glob_pattern="*.jsonl.gz", text_key="text", id_key="id")

    def removed(reason: str) -> Any:
        return JsonlWriter(str(work / "removed" / reason), output_filename="${rank}.jsonl.gz")

    yield execute("read", [_records_step(sources, opts.text_key, str(work / "bad")), _writer(work / "input")])
    current = "input"
    filters = _quality_filters(removed) if opts.quality else []
    if evals:
        index = work / "decontamination-index"
        yield execute("decontamination index", [_eval_index_step(evals, str(index), opts)], 1)
        filters.append(_decont_filter(index, opts, removed("contaminated")))
    if filters:
        yield execute("filter", [reader(current), *filters, _writer(work / "filtered")], reads=current)
        current = "filtered"
    if opts.exact:
        yield from _exact(execute, reader, current, work, removed("exact_duplicate"))
        current = "exact"
    if opts.near:
        yield from _near(execute, reader, current, work, opts, removed("near_duplicate"))
        current = "near"
    writer = JsonlWriter(str(work / "documents"), "${rank}.jsonl.gz", adapter=_output)
    yield execute("write", [reader(current), writer], reads=current)


class _Emptied(Exception):
    """No document is left in a stage's input folder."""


SCRATCH = (
    "input",
    "bad",
    "filtered",
    "exact",
    "exact-signatures",
    "exact-duplicates",
    "near",
    "signatures",
    "dedup",
    "decontamination-index",
    ".logs",
)
"""The stages' folders, removed once the output is complete."""
INTERNAL = ("file_path", "duplicate_count", "minhash_cluster_id", "minhash_cluster_size")
"""Metadata datatrove's steps add along the way, left out of the output."""


def _output(writer: Any, document: Any) -> dict[str, Any]:
    """A curated record as tokenize reads it: its text and its own fields at the top level (its own `id` where it
    had one, else file:line), with `source` and `line` saying where it came from."""
    fields = {k: v for k, v in document.metadata.items() if k not in INTERNAL}
    return {"text": document.text, "id": document.id, **fields}


def _writer(folder: Path) -> Any:
    from datatrove.pipeline.writers import JsonlWriter

    return JsonlWriter(str(folder), output_filename="${rank}.jsonl.gz")


def _quality_filters(removed: Any) -> list[Any]:
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    return [
        GopherRepetitionFilter(exclusion_writer=removed("gopher_repetition")),
        GopherQualityFilter(exclusion_writer=removed("gopher_quality")),
        C4QualityFilter(filter_no_terminal_punct=False, exclusion_writer=removed("c4_quality")),
        FineWebQualityFilter(exclusion_writer=removed("fineweb_quality")),
    ]


def _exact(execute: Any, reader: Any, current: str, work: Path, removed: Any) -> Iterator[Any]:
    from datatrove.pipeline.dedup import ExactDedupConfig, ExactDedupFilter, ExactDedupSignature, ExactFindDedups
    from datatrove.utils.text import simplify_text

    config = ExactDedupConfig(content_getter=lambda doc: simplify_text(doc.text))
    sigs, dups = work / "exact-signatures", work / "exact-duplicates"
    yield execute("exact 1/3 hashes", [reader(current), ExactDedupSignature(str(sigs), config)], reads=current)
    yield execute("exact 2/3 duplicates", [ExactFindDedups(str(sigs), str(dups), config)], 1)
    remove = ExactDedupFilter(str(dups), config, exclusion_writer=removed)
    yield execute("exact 3/3 remove", [reader(current), remove, _writer(work / "exact")], reads=current)


def _near(execute: Any, reader: Any, current: str, work: Path, opts: CurateOptions, removed: Any) -> Iterator[Any]:
    from datatrove.pipeline.dedup import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )

    bands, rows = lsh_shape(opts.near_threshold, opts.permutations)
    config = MinhashConfig(n_grams=opts.ngrams, num_buckets=bands, hashes_per_bucket=rows, seed=opts.seed)
    sigs, buckets, clusters = work / "signatures", work / "dedup" / "buckets", work / "dedup" / "clusters"
    yield execute(
        "near 1/4 signatures", [reader(current), MinhashDedupSignature(str(sigs), config=config)], reads=current
    )
    yield execute("near 2/4 buckets", [MinhashDedupBuckets(str(sigs), str(buckets), config=config)], bands)
    yield execute("near 3/4 clusters", [MinhashDedupCluster(str(buckets), str(clusters), config=config)], 1)
    yield execute(
        "near 4/4 remove",
        [reader(current), MinhashDedupFilter(str(clusters), exclusion_writer=removed), _writer(work / "near")],
        reads=current,
    )


def _decont_filter(index: Path, opts: CurateOptions, removed: Any) -> Any:
    from datatrove.pipeline.decont import NGramsDecontConfig, NGramsDecontFilter

    config = NGramsDecontConfig(n_grams=opts.decontaminate_ngrams, find_overlap_ngrams=False)
    return NGramsDecontFilter(str(index), config=config, exclusion_writer=removed)


def _records_step(sources: list[Any], text_key: str, bad: str) -> Any:
    """The first step: our readers (what tokenize reads) as datatrove documents; task `rank` of `world_size` takes
    every world_size-th document, so every task reads the inputs and each document goes to exactly one. A long
    .txt document read in blocks is joined whole. Records that cannot be read go to `bad` with file and line."""
    from datatrove.data import Document
    from datatrove.pipeline.base import PipelineStep

    class Records(PipelineStep):  # type: ignore[misc]
        type = "📖 - READER"
        name = "pipeline readers"

        def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Any:
            unreadable, n = [], 0
            for src in sources:
                parts: list[str] = []
                for r in read_records(src, text_key, keep_fields=True):
                    if r.text is None:
                        unreadable.append({"id": f"{src.path}:{r.line}", "error": r.error})
                        continue
                    parts.append(r.text)
                    if not r.last:
                        continue
                    text, parts = "".join(parts), []
                    n += 1
                    if n % world_size != rank:
                        continue
                    meta = dict(r.fields or {}) | {"source": str(src.path), "line": r.line}
                    self.stat_update("documents")
                    yield Document(text=text, id=f"{src.path}:{r.line}", metadata=meta)
            if unreadable and rank == 0:
                Path(bad).mkdir(parents=True, exist_ok=True)
                with gzip.open(Path(bad) / "00000.jsonl.gz", "wt") as f:
                    f.writelines(json.dumps(b) + "\n" for b in unreadable)

    return Records()


def _eval_index_step(sources: list[Any], folder: str, opts: CurateOptions) -> Any:
    """The decontamination index of the evaluation files the user named: the hashes of every n-gram of their
    documents, in the format datatrove's NGramsDecontFilter reads (its own indexer takes lighteval tasks only)."""
    import numpy as np
    from datatrove.pipeline.base import PipelineStep
    from datatrove.pipeline.decont import NGramsDecontConfig
    from datatrove.utils.hashing import create_hash_func
    from datatrove.utils.text import ngrams, simplify_text
    from datatrove.utils.word_tokenizers import load_word_tokenizer

    class EvalIndex(PipelineStep):  # type: ignore[misc]
        type = "🦠 - DECONT"
        name = "evaluation files index"

        def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Any:
            config = NGramsDecontConfig(n_grams=opts.decontaminate_ngrams)
            tokenizer, hash_func = load_word_tokenizer("en"), create_hash_func(config.hash_config)
            Path(folder).mkdir(parents=True, exist_ok=True)
            for i, src in enumerate(sources):
                hashes: set[int] = set()
                for r in read_records(src, opts.text_key):
                    if r.text:
                        words = tokenizer.word_tokenize(simplify_text(r.text, config.norm_config))
                        hashes.update(hash_func(" ".join(g)) for g in ngrams(words, config.n_grams))
                name = f"{i:03d}-{src.path.name.replace(' ', '_')}.index.hashes"
                np.array(sorted(hashes), dtype=config.hash_config.np_descr).tofile(Path(folder) / name)
            return iter(())

    return EvalIndex()


def read_documents(folder: Path) -> Iterator[dict[str, Any]]:
    """The records of every .jsonl.gz under `folder`, file by file in name order (an output's documents/, a
    removed/ reason, a stage's folder)."""
    for path in sorted(folder.rglob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            for line in f:
                yield json.loads(line)


def _count(work: Path, report: Report) -> None:
    """Documents and bytes read, kept and removed by reason (the exclusion writers' folders; a quality filter's
    own reason inside its folder), with the first EXAMPLES of each by id. Bytes in and out differ by more than the
    removed documents' where C4's rules drop lines from a document they keep."""
    removed: dict[str, dict[str, Any]] = {}
    for folder in sorted((work / "removed").glob("*")) if (work / "removed").exists() else []:
        for doc in read_documents(folder):
            meta = doc.get("metadata") or {}
            why = meta.get("filter_reason")
            reason = folder.name + (f": {why}" if why and why != folder.name else "")
            r = removed.setdefault(reason, {"documents": 0, "bytes": 0, "examples": []})
            r["documents"] += 1
            r["bytes"] += len(doc["text"].encode())
            r["examples"].append({"id": doc["id"], "text": doc["text"][:EXAMPLE_CHARS]})
    for r in removed.values():
        r["examples"] = sorted(r["examples"], key=lambda e: e["id"])[:EXAMPLES]
    bad = list(read_documents(work / "bad")) if (work / "bad").exists() else []
    report.bad_records = len(bad)
    if bad:
        removed["bad_record"] = {"documents": len(bad), "bytes": 0, "examples": bad[:EXAMPLES]}
    report.removed = removed
    kept = [doc for doc in read_documents(work / "documents")] if (work / "documents").exists() else []
    report.documents_kept = len(kept)
    report.bytes_kept = sum(len(d["text"].encode()) for d in kept)
    read = list(read_documents(work / "input")) if (work / "input").exists() else []
    report.documents_in = len(read)
    report.bytes_in = sum(len(d["text"].encode()) for d in read)


def lsh_note(opts: CurateOptions) -> str:
    """What the near-duplicate step finds, in one line (for --help and the log)."""
    bands, rows = lsh_shape(opts.near_threshold, opts.permutations)
    at = ", ".join(f"{s:.1f}: {found_probability(s, bands, rows):.0%}" for s in (0.3, 0.45, 0.6, 0.8))
    return f"MinHash {bands} bands x {rows} rows of word {opts.ngrams}-grams; found at similarity {at}"
