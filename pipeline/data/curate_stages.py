"""The stages of `pipeline curate` (pipeline.data.curate) as datatrove executor runs: our readers as the first step,
datatrove's filters, exact and MinHash dedup and n-gram decontamination, each stage reading the folder the one before
wrote; the LSH shape the threshold asks for; datatrove's logging kept off the terminal."""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.data.readers import read_records

if TYPE_CHECKING:
    from pipeline.data.config import CurateOptions


def lsh_shape(threshold: float, permutations: int) -> tuple[int, int]:
    """(bands, rows) with bands x rows = permutations whose LSH threshold (1 / bands) ** (1 / rows), the
    similarity found half the time, is nearest `threshold`."""
    shapes = [(permutations // r, r) for r in range(1, permutations + 1) if permutations % r == 0]
    return min(shapes, key=lambda br: abs((1 / br[0]) ** (1 / br[1]) - threshold))


def found_probability(similarity: float, bands: int, rows: int) -> float:
    """Chance LSH puts two documents of this Jaccard similarity in one bucket: 1 - (1 - s^r)^b."""
    return 1 - (1 - similarity**rows) ** bands


def quiet_datatrove() -> None:
    """datatrove's tasks log their progress and stats to stderr at INFO; keep them in the task log files (the
    stage's folder under .logs while it runs) and only warnings and errors on the terminal."""
    import sys

    import datatrove.executor.base as executor_base
    from datatrove.utils import logging as dt_logging

    def terminal() -> None:
        # an error datatrove logs with its exception is raised on to us, and said once as our one line (a full
        # disk, a bad file): its record and traceback stay in the task's log file, not on the terminal
        dt_logging.logger.remove()
        dt_logging.logger.add(sys.stderr, level="WARNING", filter=lambda record: record["exception"] is None)

    def task_logger(logging_dir: Any, rank: int, local_rank: int = 0, node_rank: int = -1) -> Any:
        terminal()
        logfile = logging_dir.open(f"logs/task_{rank:05d}.log", "w")
        dt_logging.logger.add(_unfailing(logfile), level="DEBUG", catch=False)
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
    terminal()


def _unfailing(logfile: Any) -> Any:
    """A task log's sink that cannot fail: on a full disk the task's own write fails and is said as our one line;
    its log failing too would print loguru's handler error and a traceback first."""

    def write(message: str) -> None:
        with contextlib.suppress(OSError):
            logfile.write(message)

    return write


def stages(sources: list[Any], evals: list[Any], work: Path, opts: CurateOptions) -> Iterator[Any]:
    """(name, run) per stage, in order."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    tasks = max(1, opts.workers)

    def execute(name: str, steps: list[Any], n: int = tasks, reads: str | None = None) -> Any:
        """A stage of `n` tasks; one that `reads` a folder of documents runs a task per file there, at most `n`
        (a folder left empty by the stage before ends the curation: Emptied)."""

        def run() -> None:
            count = n
            if reads is not None:
                files = len(list((work / reads).glob("*.jsonl.gz")))
                if not files:
                    raise Emptied(reads)
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
        return JsonlWriter(
            str(work / "removed" / reason), output_filename="${rank}.jsonl.gz", adapter=_removed_output(reason)
        )

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


class Emptied(Exception):
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
INTERNAL = ("file_path", "duplicate_count", "minhash_cluster_id", "minhash_cluster_size", "filter_reason")
"""Metadata datatrove's steps add along the way, left out of the output."""
REMOVAL_DETAIL = ("contaminated_task", "contaminated_ngram")
"""What a removing step says of a document it removed (decontamination: the eval text and the n-gram it shares),
kept under the removed record's `removed`, not among its own fields."""


def _output(writer: Any, document: Any) -> dict[str, Any]:
    """A curated record as tokenize reads it: its text and its own fields at the top level (its own `id` where it
    had one, else file:line), with `source` and `line` saying where it came from."""
    fields = {k: v for k, v in document.metadata.items() if k not in INTERNAL}
    return {"text": document.text, "id": document.id, **fields}


def _removed_output(reason: str) -> Any:
    """A removed record in the shape of a kept one (its text and own fields at the top level, so that putting it
    back is a copy), with `removed`: the step that removed it and, for a quality rule, the rule's own reason."""

    def adapt(writer: Any, document: Any) -> dict[str, Any]:
        why = document.metadata.get("filter_reason")
        detail = {k: document.metadata[k] for k in REMOVAL_DETAIL if k in document.metadata}
        record = {k: v for k, v in _output(writer, document).items() if k not in REMOVAL_DETAIL}
        return record | {"removed": {"by": reason, **({"why": why} if why and why != reason else {}), **detail}}

    return adapt


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
    )

    bands, rows = lsh_shape(opts.near_threshold, opts.permutations)
    config = MinhashConfig(n_grams=opts.ngrams, num_buckets=bands, hashes_per_bucket=rows, seed=opts.seed)
    sigs, buckets, clusters = work / "signatures", work / "dedup" / "buckets", work / "dedup" / "clusters"
    yield execute("near 1/4 signatures", [reader(current), bounded_signature(str(sigs), config)], reads=current)
    yield execute("near 2/4 buckets", [MinhashDedupBuckets(str(sigs), str(buckets), config=config)], bands)
    yield execute("near 3/4 clusters", [MinhashDedupCluster(str(buckets), str(clusters), config=config)], 1)
    yield execute(
        "near 4/4 remove",
        [reader(current), MinhashDedupFilter(str(clusters), exclusion_writer=removed), _writer(work / "near")],
        reads=current,
    )


BLOCK_CHARS = 1 << 20
"""A document's text is simplified and split into words this many characters at a time (at a space)."""
SHINGLE_ROWS = 1 << 15
"""Shingles hashed against the permutations this many at a time (rows x permutations x 8 bytes: 28 MiB at 112)."""


def text_blocks(text: str, size: int = BLOCK_CHARS) -> Iterator[str]:
    """`text` in pieces of about `size` characters, each ending at a whitespace (or the end), so that splitting
    every piece into words gives the words of the whole."""
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        while end < len(text) and not text[end].isspace():
            end += 1
        yield text[start:end]
        start = end


def bounded_signature(folder: str, config: Any) -> Any:
    """datatrove's MinHash signature step with the memory of a block of text, not of a document: its own
    computation materialises every word of a document and then every (word n-gram x permutation) hash at once,
    13.2 GB for one 40 MB document (newcomer trial 4). Here the words come a block at a time (the n-1 last ones
    carried into the next block, so every n-gram is hashed once), and the shingles meet the permutations
    SHINGLE_ROWS at a time, the minimum kept: the same signature, in bounded memory."""
    import numpy as np
    from datatrove.pipeline.dedup import MinhashDedupSignature
    from datatrove.pipeline.dedup.minhash import _mersenne_prime
    from datatrove.utils.text import ngrams, simplify_text

    class BoundedSignature(MinhashDedupSignature):  # type: ignore[misc]
        def get_shingles(self, text: str) -> Any:
            n, parts = self.config.n_grams, []
            carry: list[str] = []
            for block in text_blocks(text):
                words = carry + self.word_tokenizer.word_tokenize(simplify_text(block, self.config.norm_config))
                if len(words) >= n:
                    hashes = (self._hash_func(" ".join(g)) for g in ngrams(words, n))
                    parts.append(np.fromiter(hashes, dtype=np.uint64))
                carry = words[-(n - 1) :] if n > 1 else []
            return (np.concatenate(parts) if parts else np.empty(0, np.uint64)).reshape((-1, 1))

        def get_signature(self, shingles: Any) -> list[list[int]]:
            a, b = self.parameters
            best: Any = None
            for i in range(0, len(shingles), SHINGLE_ROWS):
                phv = (shingles[i : i + SHINGLE_ROWS] * a + b) % _mersenne_prime
                if self.config.hash_config.precision == 32:
                    phv = np.bitwise_and(phv, self.config.hash_config.max)
                low = phv.min(axis=0)
                best = low if best is None else np.minimum(best, low)
            signature = best.astype(self.config.hash_config.np_dtype)
            return [x.tolist() for x in np.split(signature, self.config.num_buckets)]

    return BoundedSignature(folder, config=config)


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
