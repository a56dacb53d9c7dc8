"""The operating system saying no on the user's side (a full disk, a read-only mount) is one line naming the path,
what the system said and what to do, exit code 2, and nothing half-written under a final name: on real small
tmpfs mounts (root only; skipped elsewhere, with the reason)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from pipeline.cli import main
from tests.conftest import CORPUS, Mount, tokenizer_model
from tests.multiproc import launch


def one_line_refusal(result: object, path: Path, said: str) -> None:
    out = result.output  # type: ignore[attr-defined]
    assert result.exit_code == 2, out  # type: ignore[attr-defined]
    assert "Traceback" not in out and "a bug in pipeline" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(path) in errors[0] and said in errors[0], out


def test_tokenize_into_a_full_disk_is_one_line_and_leaves_nothing_complete(mount: Mount, tokenized: Path) -> None:
    disk = mount("100k")
    out = disk / "corpus"
    args = ["tokenize", str(CORPUS), "--output-prefix", str(out), "--tokenizer", str(tokenizer_model(tokenized))]
    r = CliRunner().invoke(main, [*args, "--workers", "1"])
    one_line_refusal(r, disk, "No space left on device (ENOSPC): the disk is full")
    assert not list(disk.glob("corpus.*")), list(disk.iterdir())  # no .bin/.idx/.manifest.json under final names


def test_shard_into_a_full_disk_is_one_line_and_leaves_nothing_complete(mount: Mount, tokenized: Path) -> None:
    disk = mount("100k")
    out = disk / "shards"
    r = CliRunner().invoke(main, ["shard", str(tokenized), "--output", str(out), "--seq-len", "64"])
    one_line_refusal(r, disk, "No space left on device (ENOSPC): the disk is full")
    assert not (out / "manifest.json").exists()


def test_a_run_dir_on_a_read_only_mount_is_named_before_anything_starts(
    mount: Mount, shards: Path, tmp_path: Path
) -> None:
    """Not "0.0 GB free" (what the space check saw), and not a traceback from the first write: the mount named."""
    ro = mount("1m", ro=True)
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=ro / "run", shards=shards, ds_config="zero1.json")
    r = CliRunner().invoke(main, ["pretrain", "--config", str(cfg), "--num-gpus", "2", "--dry-run"])
    one_line_refusal(r, ro, "is on a read-only file system; put run_dir on a writable disk")
    assert "GB free" not in r.output


def test_a_libraries_own_error_around_the_systems_is_found() -> None:
    """safetensors' Rust writer and torch's zip writer raise their own types around the system's error."""
    import errno

    from pipeline.errors import os_error_in

    rust = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert os_error_in(rust).errno == errno.ENOSPC  # type: ignore[union-attr]
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system", "/x")
        except OSError as inner:
            raise RuntimeError("PytorchStreamWriter failed writing file data") from inner
    except RuntimeError as outer:
        assert os_error_in(outer).filename == "/x"  # type: ignore[union-attr]
    assert os_error_in(ValueError("a bug")) is None


def test_curate_into_a_full_disk_is_one_line_and_leaves_nothing(mount: Mount) -> None:
    """datatrove's workers log the error with a traceback and its task logs fail on the same full disk: neither
    reaches the terminal; the output is named."""
    disk = mount("64k")
    out = disk / "curated"
    r = CliRunner().invoke(main, ["curate", str(CORPUS), "--output", str(out), "--no-quality", "--workers", "1"])
    one_line_refusal(r, out, "No space left on device (ENOSPC): the disk is full")
    assert "Logging error" not in r.output and not out.exists()


def test_extend_vocab_into_a_full_disk_names_its_output(mount: Mount, tmp_path: Path) -> None:
    """safetensors' writer says only 'No space left on device' (newcomer trial 4, #39): the output is named."""
    import json

    from tests.hf_families import write_model, write_tokenizer

    model = write_model("llama", tmp_path / "m", write_tokenizer(tmp_path / "tok"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"ก ข ค ฆ {i} ง จ ฉ ช ซ ฌ"}) + "\n" for i in range(40)))
    disk = mount("64k")
    out = disk / "extended"
    r = CliRunner().invoke(main, ["extend-vocab", str(model), str(corpus), "--output", str(out), "--new-tokens", "20"])
    one_line_refusal(r, out, "No space left on device (ENOSPC): the disk is full")
    assert not out.exists()
