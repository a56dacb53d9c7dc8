"""Every command, ordinary mistakes: exit code 2, no traceback, a message naming the option or field, and nothing
left behind. Table-driven: one row per mistake."""

from __future__ import annotations

import gzip
import json
import shutil
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
    good = "".join(json.dumps({"text": f"document {i} of plain words"}) + "\n" for i in range(3))
    (tmp_path / "mixeddir").mkdir()
    (tmp_path / "mixeddir" / "good.jsonl").write_text(good)
    (tmp_path / "mixeddir" / "data.csv").write_text("text\nsome words\n")
    (tmp_path / "good.jsonl").write_text(good)
    (tmp_path / "wrongkey.jsonl").write_text('{"content": "words", "id": 1}\n{"content": "more", "id": 2}\n')
    (tmp_path / "packed.jsonl").write_bytes(gzip.compress(good.encode()))
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
    ("tokenize {CORPUS} --tokenizer {MODEL} --output-prefix {T}/o --workers 0", "--workers 0: expected"),
    ("tokenize {CORPUS} --train-tokenizer --output-prefix {T}/o --vocab-size 10", "--vocab-size 10: expected"),
    ("tokenize {CORPUS} --train-tokenizer --output-prefix {T}/o --sample-docs -1", "--sample-docs -1: expected"),
    ("tokenize {CORPUS} --tokenizer {MODEL} --output-prefix {T}/a_file/o", "a_file is not a folder"),
    ("tokenize {CORPUS} --tokenizer {MODEL} --output-prefix {T}/o --max-record-bytes lots", "--max-record-bytes"),
    ("tokenize {CORPUS} --tokenizer {MODEL} --output-prefix {T}/o --max-record-bytes 0", "--max-record-bytes"),
    (
        "tokenize {T}/mixeddir --tokenizer {MODEL} --output-prefix {T}/o",
        "type tokenize does not read would be left out",
    ),
    (
        "tokenize {T}/good.jsonl {T}/wrongkey.jsonl --tokenizer {MODEL} --output-prefix {T}/o",
        "wrongkey.jsonl: every record was skipped (missing_field 2; first: line 1: missing field 'text' (the record "
        "has content, id; set --text-key))",
    ),
    ("tokenize {T}/wrongkey.jsonl --tokenizer {MODEL} --output-prefix {T}/o", "the record has content, id"),
    ("tokenize {T}/packed.jsonl --tokenizer {MODEL} --output-prefix {T}/o", "gz-compressed but its name does not"),
    # shard
    ("shard {PREFIX} --output {T}/a_file --seq-len 64", "a_file is a file"),
    ("shard {PREFIX} --output {T}/s --seq-len 100000000", "'--seq-len'"),
    ("shard {PREFIX} --output {T}/s --seq-len 500000", "holds no whole sample"),
    ("shard {PREFIX} --output {T}/s --seq-len 0", "'--seq-len'"),
    ("shard {PREFIX} --output {T}/s --seq-len 64 --num-shards 0", "--num-shards 0: expected"),
    ("shard {PREFIX} --output {T}/s --seq-len 64 --split 1,2", "'--split': 1,2: expected three ratios"),
    ("shard {PREFIX} --output {T}/s --seq-len 64 --shard-size 0", "--shard-size"),
    ("shard {T}/nothing --output {T}/s --seq-len 64", "not a finished `pipeline tokenize` output"),
    ("shard {PREFIX}:abc --output {T}/s --seq-len 64", "the weight 'abc' after ':' is not a number"),
    ("shard {SHARDS} --output {T}/s --seq-len 64", "a shard folder (`pipeline shard`'s output); give the tokenize"),
    # evaluate
    ("evaluate --checkpoint {T} --batch-size 0", "--batch-size 0: expected"),
    ("evaluate --checkpoint {T} --max-batches -1", "--max-batches -1: expected"),
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
    ("pretrain --config {T}/badtype.yaml --num-gpu 2", "No such option '--num-gpu'. Did you mean '--num-gpus'?"),
    ("pretrain --config {T}/badtype.yaml --bogus-flag", "No such option '--bogus-flag'"),
    ("plan --probe {T}/none.json", "none.json: cannot read the probe"),
    # plan
    ("plan --hostfile {T}/nohosts", "--hostfile"),
    ("plan --hostfile {T}", "is a folder"),
    ("plan --hostfile {T}/zero", "slots=0"),
    ("plan --hostfile {T}/mixed", "different slot counts"),
    ("plan --nodes 0", "--nodes 0: expected"),
    ("plan --nodes -2", "--nodes -2: expected"),
    ("plan --gpus-per-node 0", "--gpus-per-node 0: expected"),
    ("plan --seq-len 0", "'--seq-len'"),
    ("plan --mfu 0", "--mfu 0: expected"),
    ("plan --mfu 1.5", "--mfu 1.5: expected"),
    ("plan --cpu-mem 0", "--cpu-mem"),
    ("plan --gpu-mem 0", "--gpu-mem"),
    ("plan --network 0 --nodes 2", "--network"),
    ("plan --layers 0", "--layers 0: expected"),
    ("plan --tokens 0", "--tokens"),
    ("plan --nvme -3TB", "--nvme -3TB"),
    ("plan --config {T}/none.yaml", "no such config file"),
    ("plan --from-run {T}", "not a run folder"),
    ("plan --micro-batch-size -1", "--micro-batch-size -1: expected"),
    ("plan --gpu voodoo2", "unknown GPU 'voodoo2'"),
    ("plan --gpu 4090ti", "'4090ti' is not the RTX 4090"),  # not planned as the card its name starts with
    ("plan --gpu 3090ti", "'3090ti' is not the RTX 3090"),
    ("plan --tokens 100GB", "expected a number of tokens such as 1B, 100bn"),
    # a size without its unit, wherever a size is typed (512 meant as MB would be 512 bytes)
    ("shard {PREFIX} --output {T}/s --seq-len 64 --shard-size 512", "'512': a size needs its unit, e.g. 512MB"),
    ("tokenize {CORPUS} --tokenizer {MODEL} --output-prefix {T}/o --max-record-bytes 256", "a size needs its unit"),
    ("export --checkpoint {T} --output {T}/e --max-shard-size 2", "'2': a size needs its unit"),
    ("plan --nvme 2000", "'2000': a size needs its unit"),
    ("plan --cpu-mem 512", "'512': a size needs its unit"),
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


@pytest.fixture
def launch_work(tmp_path: Path, shards: Path) -> dict[str, Path]:
    """Run configs whose launch `pipeline pretrain` must refuse before the launcher starts: shards damaged three
    ways, a run folder whose checkpoint is of another model or seq_len, init_from without weights."""
    from pipeline.train.checkpoint import files as ckpt
    from pipeline.train.setup.config import load
    from pipeline.train.setup.prepare import prepare

    def config(name: str, data: Path, run_dir: Path, model: str = "{preset: tiny}") -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(
            f"run_dir: {run_dir}\nmodel: {model}\ndata: {{path: {data}, verify: true}}\n"
            "batch: {micro_batch_size: 2, global_batch_size: 8}\n"
            "train: {max_steps: 20, precision: fp32, deepspeed_config: ds_configs/zero2.json}\n"
        )
        return path

    out: dict[str, Path] = {"T": tmp_path}
    for damage in ("missing", "truncated", "altered"):
        copy = tmp_path / f"shards-{damage}"
        shutil.copytree(shards, copy)
        shard = copy / "train-00000.bin"
        data = bytearray(shard.read_bytes())
        if damage == "missing":
            shard.unlink()
        elif damage == "truncated":
            shard.write_bytes(bytes(data[:-10]))
        else:
            data[100] ^= 0xFF
            shard.write_bytes(bytes(data))
        out[damage] = config(damage, copy, tmp_path / f"runs/{damage}")
    prepared = prepare(load(config("ok", shards, tmp_path / "runs/x")), 2)
    for name, change in (("shape", {"hidden_size": 128}), ("seq", {})):
        run_dir = tmp_path / f"runs/{name}"
        (run_dir / "step00000010").mkdir(parents=True)
        marker = {
            "step": 10,
            "consumed_samples": 80,
            "data_fingerprint": prepared.manifest["fingerprint"] if name == "shape" else "0" * 64,
            "seq_len": 64 if name == "shape" else 32,
            "tokenizer_sha256": prepared.manifest["tokenizer"]["sha256"],
            "model_shape": {**prepared.shape.as_dict(), **change},
            "world_size": 2,
        }
        ckpt.mark_complete(run_dir, "step00000010", marker)  # type: ignore[arg-type]
        out[name] = config(name, shards, run_dir)
    (tmp_path / "empty-model").mkdir()
    out["noweights"] = config(
        "noweights", shards, tmp_path / "runs/nw", f"{{preset: tiny, init_from: {tmp_path}/empty-model}}"
    )
    out["busy"] = config("busy", shards, tmp_path / "runs/busy")
    out["relative"] = config("relative", Path("data/no-such-shards"), tmp_path / "runs/rel")
    (tmp_path / "runs/busy").mkdir(parents=True)
    (tmp_path / "ok.yaml").unlink()
    return out


LAUNCH_CASES = [
    ("missing", "train-00000.bin: missing but the manifest says"),
    ("truncated", "bytes but the manifest says"),
    ("altered", "train-00000.bin: checksum differs from the manifest"),
    ("shape", "model hidden_size 64 vs the checkpoint's 128"),
    ("seq", "seq_len 64 (the shards of data.path) vs the checkpoint's 32"),
    ("noweights", "empty-model: no .safetensors file there (it is empty)"),
    ("busy", "is in use by another training (pid"),
    ("relative", "data/no-such-shards: no such folder (a relative path, read from the working directory /"),
]


@pytest.mark.parametrize("case, expected", LAUNCH_CASES, ids=[c[0] for c in LAUNCH_CASES])
def test_pretrain_refuses_before_the_launcher_starts(launch_work: dict[str, Path], case: str, expected: str) -> None:
    """One line naming the field and both values, exit 2, nothing written, and no launcher started (the command
    it would run is printed as `+ deepspeed ...` only when it launches)."""
    from pipeline.train.setup.runlock import RunLock

    lock = RunLock(launch_work["T"] / "runs/busy")
    lock.acquire()  # another live training holds that folder
    try:
        before = sorted(p.relative_to(launch_work["T"]) for p in launch_work["T"].rglob("*"))
        r = CliRunner().invoke(main, ["pretrain", "--config", str(launch_work[case]), "--num-gpus", "2"])
        after = sorted(p.relative_to(launch_work["T"]) for p in launch_work["T"].rglob("*"))
    finally:
        lock.release()
    assert r.exit_code == 2 and expected in r.output, r.output
    assert "+ " not in r.output and "Traceback" not in r.output
    assert after == before, f"left behind: {set(after) - set(before)}"


def test_python_m_pipeline_is_the_pipeline_command() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pipeline", "plan", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("Usage: pipeline plan"), out.stdout + out.stderr
