"""Every command, ordinary mistakes: exit code 2, no traceback, a message naming the option or field, and nothing
left behind. Table-driven: one row per mistake."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests.conftest import CORPUS


@pytest.fixture
def work(tmp_path: Path, tokenized: Path, shards: Path) -> dict[str, str]:
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    (tmp_path / "mixed").write_text("node1 slots=4\nnode2 slots=2\n")
    (tmp_path / "zero").write_text("node1 slots=0\n")
    (tmp_path / "badtype.yaml").write_text(
        f"data: {{path: {shards}}}\nbatch: {{micro_batch_size: two, global_batch_size: 8}}\ntrain: {{max_steps: 3}}\n"
    )
    return {
        "T": str(tmp_path),
        "PREFIX": str(tokenized),
        "MODEL": str(tokenized) + ".tokenizer.model",
        "SHARDS": str(shards),
        "CORPUS": str(CORPUS),
    }


CASES = [
    # tokenize
    ("tokenize {T}/nope.jsonl --tokenizer {MODEL} --output-prefix {T}/o", "nope.jsonl: no such file"),
    ("tokenize {CORPUS} --tokenizer {MODEL} --output-prefix {T}/o --workers 0", "'--workers'"),
    ("tokenize {CORPUS} --train-tokenizer --output-prefix {T}/o --vocab-size 10", "'--vocab-size'"),
    ("tokenize {CORPUS} --train-tokenizer --output-prefix {T}/o --sample-docs -1", "'--sample-docs'"),
    ("tokenize {CORPUS} --tokenizer {MODEL} --output-prefix {T}/a_file/o", "a_file is not a folder"),
    ("tokenize {CORPUS} --tokenizer {MODEL} --output-prefix {T}/o --max-record-bytes lots", "--max-record-bytes"),
    ("tokenize {CORPUS} --tokenizer {MODEL} --output-prefix {T}/o --max-record-bytes 0", "--max-record-bytes"),
    # shard
    ("shard {PREFIX} --output {T}/a_file --seq-len 64", "a_file is a file"),
    ("shard {PREFIX} --output {T}/s --seq-len 100000000", "'--seq-len'"),
    ("shard {PREFIX} --output {T}/s --seq-len 500000", "holds no whole sample"),
    ("shard {PREFIX} --output {T}/s --seq-len 0", "'--seq-len'"),
    ("shard {PREFIX} --output {T}/s --seq-len 64 --num-shards 0", "'--num-shards'"),
    ("shard {PREFIX} --output {T}/s --seq-len 64 --split 1,2", "--split 1,2"),
    ("shard {PREFIX} --output {T}/s --seq-len 64 --shard-size 0", "--shard-size"),
    ("shard {T}/nothing --output {T}/s --seq-len 64", "not a finished `pipeline tokenize` output"),
    # evaluate
    ("evaluate --checkpoint {T} --batch-size 0", "'--batch-size'"),
    ("evaluate --checkpoint {T} --max-batches -1", "'--max-batches'"),
    ("evaluate --checkpoint {T}/norun", "no such run folder"),
    ("evaluate --checkpoint {T} --prompts {T}/none.txt", "--prompts"),
    ("evaluate --checkpoint {T} --device cuda:7", "--device cuda:7"),
    ("evaluate --checkpoint {T} --device tpu", "--device tpu"),
    ("evaluate --checkpoint {T} --output {T}/foreign", "is a folder"),
    # export
    ("export --checkpoint {T} --output {T}/a_file", "a_file: is a file"),
    ("export --checkpoint {T} --output {T}/foreign", "holds other files"),
    ("export --checkpoint {T} --output {T}/a_file/x", "a_file is a file"),
    ("export --checkpoint {T} --output {T}/e --max-shard-size 0", "--max-shard-size"),
    ("export --checkpoint {T} --output {T}/e --dtype fp8", "'--dtype'"),
    # pretrain
    ("pretrain --config {T}/none.yaml --num-gpus 2", "no such config file"),
    ("pretrain --config {T}/badtype.yaml --num-gpus 2", "batch.micro_batch_size: expected an integer"),
    ("pretrain --config {T}/badtype.yaml --num-gpus 0", "'--num-gpus'"),
    ("pretrain --config {T}/badtype.yaml --hostfile {T}/nohosts", "--hostfile"),
    # plan
    ("plan --hostfile {T}/nohosts", "--hostfile"),
    ("plan --hostfile {T}", "is a folder"),
    ("plan --hostfile {T}/zero", "slots=0"),
    ("plan --hostfile {T}/mixed", "different slot counts"),
    ("plan --nodes 0", "'--nodes'"),
    ("plan --nodes -2", "'--nodes'"),
    ("plan --gpus-per-node 0", "'--gpus-per-node'"),
    ("plan --seq-len 0", "'--seq-len'"),
    ("plan --mfu 0", "'--mfu'"),
    ("plan --mfu 1.5", "'--mfu'"),
    ("plan --cpu-mem 0", "--cpu-mem"),
    ("plan --gpu-mem 0", "--gpu-mem"),
    ("plan --network 0 --nodes 2", "--network"),
    ("plan --layers 0", "'--layers'"),
    ("plan --tokens 0", "--tokens"),
    ("plan --nvme -3TB", "--nvme -3TB"),
    ("plan --config {T}/none.yaml", "no such config file"),
    ("plan --from-run {T}", "not a run folder"),
    ("plan --micro-batch-size -1", "'--micro-batch-size'"),
    ("plan --gpu voodoo2", "unknown GPU 'voodoo2'"),
]


@pytest.mark.parametrize(
    "args, expected", CASES, ids=[c[0].split(" --")[0].split(" {")[0] + ": " + c[1] for c in CASES]
)
def test_mistake_gives_one_clear_error(work: dict[str, str], args: str, expected: str) -> None:
    before = sorted(p.relative_to(work["T"]) for p in Path(work["T"]).rglob("*"))
    r = CliRunner().invoke(main, args.format(**work).split())
    assert r.exit_code == 2, r.output
    assert expected in r.output, r.output
    assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception, SystemExit)
    after = sorted(p.relative_to(work["T"]) for p in Path(work["T"]).rglob("*"))
    assert after == before, f"left behind: {set(after) - set(before)}"


def test_internal_errors_say_they_are_bugs(work: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.data import shard as shard_stage

    def broken(cfg: object) -> None:
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(shard_stage, "run", broken)
    r = CliRunner().invoke(main, ["shard", work["PREFIX"], "--output", work["T"] + "/s", "--seq-len", "64"])
    assert r.exit_code == 1
    assert "bug in pipeline" in r.output
