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
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.atomic import replacing_dir, write_json
from pipeline.data.config import CurateOptions
from pipeline.data.curate_stages import SCRATCH, Emptied, found_probability, lsh_shape, quiet_datatrove, stages
from pipeline.data.readers import resolve_inputs
from pipeline.errors import PipelineError, writing_into

log = logging.getLogger(__name__)
NEEDED = "pip install -e '.[curate]' (datatrove[processing] and spacy)"
EXAMPLES = 3  # removed documents shown per reason in the report
EXAMPLE_CHARS = 300


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
    warnings: list[str] = field(default_factory=list)
    """What looks wrong with a result that is legal (`warnings_of`): said beside the summary and kept here."""

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
        lines += [f"warning: {w}" for w in self.warnings]
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
    for given in map(Path, inputs):
        if given.is_dir() and out.resolve().is_relative_to(given.resolve()):
            raise PipelineError(
                f"--output {out} is inside the input folder {given}: a second run would read its own output "
                "(documents and removed ones) as input; put the output beside the input folder"
            )
    if out.exists() and not (out / "report.json").exists() and any(out.iterdir()):
        raise PipelineError(f"--output {out}: a folder that is not a curate output; name an empty or new folder")
    report = Report([str(s.path) for s in sources], asdict(opts) | {"decontaminate": list(opts.decontaminate)})
    quiet_datatrove()
    with writing_into(out), replacing_dir(out, "another `pipeline curate`") as work:  # whole, or none on error
        try:
            for name, run in stages(sources, evals, work, opts):
                t0 = time.perf_counter()
                run()
                report.seconds[name] = round(time.perf_counter() - t0, 2)
                echo(f"curate: {name} done in {report.seconds[name]:.1f} s")
        except Emptied:
            pass  # counted below: nothing read, or everything removed
        _count(work, report)
        if report.documents_in == 0:
            first = report.removed.get("bad_record", {}).get("examples", [])[:1]
            why = f"; first: {first[0]['id']}: {first[0].get('error')}" if first else ""
            key = (
                f" (--text-key {opts.text_key} names the field of the inputs and of --decontaminate's files alike)"
                if opts.decontaminate and opts.text_key != "text"
                else ""
            )
            raise PipelineError(
                f"{', '.join(inputs)}: no readable document (bad records: {report.bad_records}){why}{key}"
            )
        if report.documents_kept == 0:
            said = [w for w in warnings_of(report) if "13-gram" in w]
            raise PipelineError(
                f"every one of the {report.documents_in:,} documents was removed ({', '.join(report.removed)}); "
                + (
                    said[0]
                    if said
                    else "turn off the step that took them (--no-quality, --no-near, ...) or lower its bar"
                )
            )
        for scratch in SCRATCH:
            shutil.rmtree(work / scratch, ignore_errors=True)
        report.warnings = warnings_of(report)
        write_json(work / "report.json", asdict(report))
    for line in report.summary(out):
        echo(line)
    return report


KEPT_TOO_FEW, CONTAMINATED_TOO_MANY = 0.10, 0.20
"""Below this share kept, or above this share found in the eval set, a curate result is more likely a mistake
than the corpus (a template-heavy scrape, the wrong step for this text, the training data given as the eval set)."""
TURN_OFF = {
    "gopher_repetition": "--no-quality",
    "gopher_quality": "--no-quality",
    "c4_quality": "--no-quality",
    "fineweb_quality": "--no-quality",
    "exact_duplicate": "--no-exact",
    "near_duplicate": "--no-near (or a higher --near-threshold)",
}


def warnings_of(report: Report) -> list[str]:
    """What looks wrong with a legal result: almost everything removed by one step, or most of the corpus found in
    the eval set; each naming the step, its share and the way to look and to change it."""
    out: list[str] = []
    n = report.documents_in
    if n == 0:
        return out
    contaminated = report.removed.get("contaminated", {}).get("documents", 0)
    if contaminated / n > CONTAMINATED_TOO_MANY:
        out.append(
            f"{contaminated / n:.0%} of the documents share a 13-gram with --decontaminate's files: check that they "
            "are your evaluation set and not the training data itself (or a copy of it)"
        )
    if report.documents_kept / n < KEPT_TOO_FEW and report.removed:
        reason, r = max(report.removed.items(), key=lambda kv: kv[1]["documents"])
        step = reason.split(":")[0]
        how = f"; if it took what you meant to keep, {TURN_OFF[step]}" if step in TURN_OFF else ""
        out.append(
            f"only {report.documents_kept / n:.1%} of the documents were kept; {reason} removed {r['documents']:,} "
            f"({r['documents'] / n:.0%}): see its examples in report.json{how}"
        )
    return out


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
            why = (doc.get("removed") or {}).get("why")
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
