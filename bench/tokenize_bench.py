"""Tokenize throughput, all in one run on the same >= 200 MB corpus (the demo corpus repeated):
  (a) sentencepiece encode of the documents in a tight loop, one process: the limit for this tokenizer;
  (b) `pipeline tokenize --workers 1`; (c) `--workers 2`;
  (d) what users do today: datasets `map(num_proc=2)` with the same tokenizer, ids written to disk;
  (e, f) the same text as ONE document (a .txt file), `--workers 1` and `2`: read and encoded in pieces.
Peak RSS (the main process and, separately, its largest worker) beside each pipeline case.
Usage: python bench/tokenize_bench.py [--mb 200] (needs `make data` first)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--vocab-size", type=int, default=8000)
    args = ap.parse_args()
    demo = ROOT / "data" / "shakespeare.jsonl"
    if not demo.exists():
        sys.exit("run `make data` first")
    work = Path(tempfile.mkdtemp(prefix="tokbench-"))
    try:
        one = demo.read_text()
        corpus = work / "corpus.jsonl"
        with open(corpus, "w") as f:
            for _ in range(max(1, -(-args.mb * 10**6 // len(one.encode())))):
                f.write(one)
        size = corpus.stat().st_size
        py = sys.executable
        cli = [
            py,
            "-m",
            "pipeline.cli",
            "tokenize",
            str(demo),
            "--output-prefix",
            str(work / "tok"),
            "--train-tokenizer",
            "--vocab-size",
            str(args.vocab_size),
        ]
        subprocess.run(cli, check=True, capture_output=True)
        model = work / "tok.tokenizer.model"

        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(model))
        texts = [json.loads(line)["text"] for line in one.splitlines()]
        reps = max(1, -(-args.mb * 10**6 // len(one.encode())))
        t0 = time.perf_counter()
        tokens_a = 0
        for _ in range(reps):
            for ids in sp.encode(texts, return_type="numpy", num_threads=1):
                tokens_a += len(ids) + 1
        a = tokens_a / (time.perf_counter() - t0)

        rss_code = (
            "import resource, sys; from pipeline.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
            " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
        )

        def run_pipeline(source: Path, workers: int, name: str) -> tuple[float, int, float, float]:
            prefix = work / name
            t = time.perf_counter()
            out = subprocess.run(
                [
                    py,
                    "-c",
                    rss_code,
                    "tokenize",
                    str(source),
                    "--output-prefix",
                    str(prefix),
                    "--tokenizer",
                    str(model),
                    "--workers",
                    str(workers),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            dt = time.perf_counter() - t
            main_kb, child_kb = out.stdout.split()[-2:]
            m = json.loads(Path(str(prefix) + ".manifest.json").read_text())
            return m["totals"]["tokens"] / dt, m["totals"]["tokens"], int(main_kb) / 1024, int(child_kb) / 1024

        b, tokens_b, rss_b, _ = run_pipeline(corpus, 1, "w1")
        c, _, rss_c, child_c = run_pipeline(corpus, 2, "w2")
        same = (work / "w1.bin").read_bytes() == (work / "w2.bin").read_bytes()
        single = work / "one_document.txt"
        with open(single, "w") as f:
            for _ in range(reps):
                f.write("\n\n".join(texts) + "\n\n")
        e, _, rss_e, _ = run_pipeline(single, 1, "s1")
        f_, _, rss_f, child_f = run_pipeline(single, 2, "s2")
        single_mb = single.stat().st_size / 1e6

        code = f"""
import time, sentencepiece as spm, datasets, numpy as np
datasets.disable_progress_bars()
t = time.perf_counter()
sp = spm.SentencePieceProcessor(model_file={str(model)!r})
dataset = datasets.load_dataset("json", data_files={str(corpus)!r}, split="train", cache_dir={str(work / "hfcache")!r})
def enc(batch):
    return {{"ids": [list(x) + [2] for x in sp.encode(batch["text"], num_threads=1)]}}
out = dataset.map(enc, batched=True, num_proc=2, remove_columns=dataset.column_names)
out.save_to_disk({str(work / "hfout")!r})
print(sum(len(x) for x in out["ids"]), time.perf_counter() - t)
"""
        res = subprocess.run([py, "-c", code], check=True, capture_output=True, text=True)
        tokens_d, dt_d = res.stdout.split()[-2:]
        d = int(tokens_d) / float(dt_d)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; corpus {size / 1e6:.0f} MB, {tokens_b:,} tokens, vocab {args.vocab_size}"
    )
    print("| what | tokens/s | ratio |")
    print("|---|---:|---:|")
    print(f"| (a) sentencepiece encode, tight loop, 1 process (limit) | {a:,.0f} | 1.00 x (a) |")
    print(f"| (b) `pipeline tokenize --workers 1` (peak RSS {rss_b:.0f} MB) | {b:,.0f} | {b / a:.2f} x (a) |")
    print(
        f"| (c) `pipeline tokenize --workers 2` (peak RSS {rss_c:.0f} MB, worker {child_c:.0f} MB) | {c:,.0f} | "
        f"{c / b:.2f} x (b) |"
    )
    print(f"| (d) datasets `map(num_proc=2)` + save_to_disk | {d:,.0f} | (c) is {c / d:.2f} x (d) |")
    print(
        f"| (e) one {single_mb:.0f} MB document (.txt), `--workers 1` (peak RSS {rss_e:.0f} MB) | {e:,.0f} | "
        f"{e / b:.2f} x (b) |"
    )
    print(
        f"| (f) the same, `--workers 2` (peak RSS {rss_f:.0f} MB, worker {child_f:.0f} MB) | {f_:,.0f} | "
        f"{f_ / e:.2f} x (e) |"
    )
    print(f"workers 1 and 2 byte-identical: {same}")


if __name__ == "__main__":
    main()
