"""Stage 4 on real checkpoints from 2-rank ZeRO runs: export round trip through transformers, tokenizer round
trip, a real perplexity signal, and the error cases."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.data.loader import ShardedDataset
from pipeline.data.tokenizer import Tokenizer
from pipeline.evaluate.export import export as export_checkpoint
from pipeline.evaluate.inputs import EvalConfig, open_run
from pipeline.evaluate.run import perplexity
from pipeline.evaluate.run import run as evaluate_run
from tests.multiproc import launch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine_logits(zero_runs: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """The ZeRO-1 and ZeRO-3 runs' last checkpoints loaded into real 2-rank engines (one launch): their logits on
    val sample 0, by stage."""
    tmp = tmp_path_factory.mktemp("logits")
    cases = [
        {
            "config": str(zero_runs[s].parent / f"{zero_runs[s].name}.yaml"),
            "tag": "step00000020",
            "out": str(tmp / f"{s}.pt"),
        }
        for s in (1, 3)
    ]
    res = launch.run_script(ROOT / "tests/multiproc/engine_logits.py", json.dumps(cases))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return {s: torch.load(tmp / f"{s}.pt") for s in (1, 3)}


@pytest.mark.parametrize("stage", [1, 3])
def test_exported_model_reproduces_engine_logits(
    zero_runs: dict[int, Path], engine_logits: dict[int, dict], tmp_path: Path, stage: int
) -> None:
    from transformers import AutoModelForCausalLM

    run_dir = zero_runs[stage]
    ref = engine_logits[stage]
    hf_dir = export_checkpoint(str(run_dir), str(tmp_path / "hf"), dtype="fp32", max_shard_bytes=200_000)
    assert len(list(hf_dir.glob("model-*.safetensors"))) > 1 and (hf_dir / "model.safetensors.index.json").exists()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    with torch.no_grad():
        got = model(input_ids=ref["input_ids"]).logits
    torch.testing.assert_close(got, ref["logits"], rtol=1e-5, atol=1e-5)
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and (hf_dir / "generation_config.json").exists()


def test_exported_tokenizer_matches_pipeline_tokenizer(zero_runs: dict[int, Path], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf_dir = export_checkpoint(str(zero_runs[2]), str(tmp_path / "hf"), dtype="bf16")
    ours = Tokenizer(ShardedDataset(open_run(zero_runs[2]).config["data"]["path"]).tokenizer_path)  # type: ignore[arg-type]
    theirs = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    texts = [
        "To be, or not to be: that is the question.",
        "  two  spaces\tand a tab\n\nand 12345 digits",
        "春天来了，花园里的花都开了。",
        "混合 mixed 文本 text 2026年11月30日",
        "Ελληνικά 🙂",
    ]
    for t in texts:
        assert theirs.encode(t, add_special_tokens=False) == ours.encode(t), t
        assert theirs.decode(ours.encode(t)) == t
    assert theirs.eos_token_id == ours.eos_id and theirs.pad_token_id == ours.pad_id


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_export_stopped_over_an_earlier_one_leaves_it_whole(
    zero_runs: dict[int, Path], tmp_path: Path, sig: int
) -> None:
    """`pipeline export` as every writing command (tests/unit/test_writers.py): stopped while it holds its output
    over an earlier export, it says so in one line, the earlier folder is as it was and nothing is beside it; the
    same command then completes."""
    from tests.unit.test_writers import PIPELINE, SAYS, snapshot, stopped_holding

    out = tmp_path / "hf"
    args = [PIPELINE, "export", "--checkpoint", str(zero_runs[1]), "--output", str(out)]
    done = subprocess.run(args, env=launch.env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    before = snapshot(out)
    second = [*args, "--dtype", "fp32"]
    stopped = stopped_holding(second, tmp_path / ".hf.lock", sig)
    code, says = SAYS[sig]
    assert stopped.returncode == code and stopped.stderr.strip().splitlines()[-1] == says, stopped.stderr[-3000:]
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    again = subprocess.run(second, env=launch.env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and snapshot(out) != before, again.stderr[-3000:]


def test_export_writes_gguf_files_that_load_with_the_engines_logits_and_our_ids(
    zero_runs: dict[int, Path], engine_logits: dict[int, dict], tmp_path: Path
) -> None:
    """`pipeline export --gguf f16 --gguf q8_0` on a trained ZeRO-3 run: two .gguf files beside the Hugging Face
    folder; transformers' GGUF loader gives the engine's logits (f16: within the bf16 export's rounding; q8_0:
    within 3% of the largest logit) and the file's vocabulary is the run's sentencepiece model's."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    import shutil

    import sentencepiece as spm
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from pipeline.cli import main
    from tests.unit.evaluate.test_to_gguf import assert_vocabulary_is

    run_dir = zero_runs[3]
    ref = engine_logits[3]
    out = tmp_path / "hf"
    r = CliRunner().invoke(
        main, ["export", "--checkpoint", str(run_dir), "--output", str(out), "--gguf", "f16", "--gguf", "q8_0"]
    )
    assert r.exit_code == 0, r.output
    tok_path = ShardedDataset(open_run(run_dir).config["data"]["path"]).tokenizer_path  # type: ignore[arg-type]
    for kind, tolerance in (("f16", 0.01), ("q8_0", 0.03)):
        path = out / f"hf-{kind}.gguf"
        assert f"wrote {path}" in r.output
        alone = tmp_path / kind
        alone.mkdir()
        shutil.copyfile(path, alone / path.name)
        model = AutoModelForCausalLM.from_pretrained(alone, gguf_file=path.name, dtype=torch.float32).eval()
        with torch.no_grad():
            got = model(input_ids=ref["input_ids"]).logits
        scale = ref["logits"].abs().max().item()
        assert (got - ref["logits"]).abs().max().item() <= tolerance * scale, kind
        assert_vocabulary_is(path, spm.SentencePieceProcessor(model_file=str(tok_path)))


def test_trained_model_beats_fresh_init_on_held_out_data(zero_runs: dict[int, Path], tmp_path: Path) -> None:
    from pipeline.model import build_model
    from pipeline.train.runtime.weights import init_weights

    res = evaluate_run(
        EvalConfig(checkpoint=str(zero_runs[1]), split="val", output=str(tmp_path / "e.json"), max_new_tokens=8)
    )
    run = open_run(zero_runs[1])
    dataset = ShardedDataset(run.config["data"]["path"], "val")
    fresh = build_model(run.shape).eval()
    init_weights(fresh, 1234, 0, stage3=False)
    base = perplexity(fresh, dataset, Tokenizer(dataset.tokenizer_path))  # type: ignore[arg-type]
    assert res["loss"] < base["loss"] - 0.5 and res["perplexity"] < 0.6 * base["perplexity"]
    assert 0 < res["bits_per_byte"] < base["bits_per_byte"]
    assert res["step"] == 20 and res["tokens"] == len(dataset) * 64
    saved = json.loads((tmp_path / "e.json").read_text())
    assert saved["loss"] == res["loss"] and len(saved["samples_generated"]) == 4
    assert (zero_runs[1] / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_zero3_checkpoint_evaluates_like_zero1(zero_runs: dict[int, Path], tmp_path: Path) -> None:
    a = evaluate_run(
        EvalConfig(checkpoint=str(zero_runs[1]), max_batches=2, output=str(tmp_path / "a.json"), max_new_tokens=2)
    )
    b = evaluate_run(
        EvalConfig(
            checkpoint=str(zero_runs[3] / "step00000020"),
            max_batches=2,
            output=str(tmp_path / "b.json"),
            max_new_tokens=2,
        )
    )
    assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-4  # same training, other partitioning


def test_zero3_evaluation_across_two_ranks_equals_one_process(zero_runs: dict[int, Path], tmp_path: Path) -> None:
    """`pipeline evaluate --num-gpus 2`: the model split across two ranks with ZeRO-3 (as a checkpoint larger than
    one GPU is evaluated); 3 batches over 2 ranks, so one rank runs a discarded extra forward."""
    one = evaluate_run(
        EvalConfig(
            checkpoint=str(zero_runs[1]),
            max_batches=3,
            batch_size=4,
            output=str(tmp_path / "one.json"),
            max_new_tokens=6,
        )
    )
    cmd = [
        str(Path(sys.executable).parent / "pipeline"),
        "evaluate",
        "--checkpoint",
        str(zero_runs[1]),
        "--max-batches",
        "3",
        "--batch-size",
        "4",
        "--output",
        str(tmp_path / "two.json"),
        "--max-new-tokens",
        "6",
        "--num-gpus",
        "2",
        "--master-port",
        str(launch.free_port()),
    ]
    res = subprocess.run(cmd, env=launch.env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "bits per byte" in res.stdout and str(tmp_path / "two.json") in res.stdout
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["ranks"] == 2 and two["zero_stage"] == 3
    assert (
        (two["tokens"], two["bytes"], two["samples"])
        == (one["tokens"], one["bytes"], one["samples"])
        == (3 * 4 * 64, one["bytes"], 12)
    )
    for key in ("loss", "bits_per_byte", "perplexity"):
        assert abs(two[key] - one[key]) <= 1e-5 * one[key], key
    assert [s["greedy"] for s in two["samples_generated"]] == [s["greedy"] for s in one["samples_generated"]]


def test_error_cases(zero_runs: dict[int, Path], tmp_path: Path, tokenized: Path) -> None:
    from pipeline.data import shard as shard_stage
    from pipeline.data.config import ShardConfig

    def cli(*args: str):
        return CliRunner().invoke(main, ["evaluate", *args])

    r = cli("--checkpoint", str(tmp_path))
    assert r.exit_code == 2 and "holds no complete checkpoint" in r.output
    partial = tmp_path / "run"
    shutil.copytree(zero_runs[2], partial)
    (partial / "step00000020" / "pipeline_complete.json").unlink()
    r = cli("--checkpoint", str(partial / "step00000020"))
    assert r.exit_code == 2 and "incomplete (still being written" in r.output
    other = tmp_path / "seq32"
    shard_stage.run(ShardConfig(sources=((str(tokenized), 1.0),), output=str(other), seq_len=32, progress=False))
    r = cli("--checkpoint", str(zero_runs[2]), "--data", str(other))
    assert r.exit_code == 2 and "seq_len 32 differs from the run's 64" in r.output
    # Shards without a val split: a perfect score for nothing is refused, and nothing is written.
    no_val = tmp_path / "no-val"
    cfg = ShardConfig(
        sources=((str(tokenized), 1.0),), output=str(no_val), seq_len=64, split=(100, 0, 0), progress=False
    )
    shard_stage.run(cfg)
    before = sorted((zero_runs[2] / "eval").glob("*")) if (zero_runs[2] / "eval").exists() else []
    r = cli("--checkpoint", str(zero_runs[2]), "--data", str(no_val))
    assert r.exit_code == 2 and "the val split has no samples (the shards were made with --split 100,0,0)" in r.output
    assert "evaluate another split (train" in r.output
    after = sorted((zero_runs[2] / "eval").glob("*")) if (zero_runs[2] / "eval").exists() else []
    assert after == before


def test_an_export_whose_shards_moved_is_refused_instead_of_losing_its_tokenizer(
    zero_runs: dict[int, Path], tmp_path: Path
) -> None:
    """The tokenizer and its special tokens come from the shards' manifest: with the shards gone the export used to
    write the weights alone and still say `AutoTokenizer.from_pretrained` would load them."""
    run_dir = tmp_path / "run"
    shutil.copytree(zero_runs[1], run_dir, ignore=shutil.ignore_patterns("*.universal", "tb"))
    cfg = run_dir / "config.yaml"
    # as an older run's config (no seal; a sealed one edited is refused: tests/unit/test_sealed.py)
    unsealed = cfg.read_text().partition("\n")[2]
    cfg.write_text(unsealed.replace(str(_data_path(zero_runs[1])), str(tmp_path / "moved")))
    r = CliRunner().invoke(main, ["export", "--checkpoint", str(run_dir), "--output", str(tmp_path / "hf")])
    assert r.exit_code == 2 and f"{tmp_path / 'moved'}: the run's shards are not there (moved?)" in r.output
    assert "pass --data DIR" in r.output and not (tmp_path / "hf").exists()
    # the shards where they are now: the export with its tokenizer
    args = [
        "export",
        "--checkpoint",
        str(run_dir),
        "--output",
        str(tmp_path / "hf"),
        "--data",
        _data_path(zero_runs[1]),
    ]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and (tmp_path / "hf" / "tokenizer.model").is_file()


def _data_path(run_dir: Path) -> str:
    import yaml

    return str(yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["path"])


def test_an_export_into_a_full_disk_is_one_line_naming_it(zero_runs: dict[int, Path], mount) -> None:  # type: ignore[no-untyped-def]
    """safetensors' writer raises its own error around the system's ENOSPC: one line naming the output, nothing
    left under the final name."""
    disk = mount("64k")
    out = disk / "hf"
    r = CliRunner().invoke(main, ["export", "--checkpoint", str(zero_runs[1]), "--output", str(out)])
    assert r.exit_code == 2 and "Traceback" not in r.output and "a bug in pipeline" not in r.output, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {out}: No space left on device (ENOSPC): the disk is full: free space there, or write elsewhere. "
        "Nothing half-written was left under a final name"
    ]
    assert not out.exists()


@pytest.fixture(scope="module")
def continued(two_sources: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A tiny model continued from a base (`model.init_from`, a safetensors file) on one source of a blend only,
    the domain ("second"), 12 steps; evaluated with `--baseline --needle 64,128 --data BLEND`: (run, result)."""
    from safetensors.torch import save_model

    from pipeline.model import build_model, resolve_shape
    from tests.conftest import shard_into

    tmp_path = tmp_path_factory.mktemp("continued")
    tok = Tokenizer(ShardedDataset(two_sources, "val").tokenizer_path)
    torch.manual_seed(7)
    base = tmp_path / "base.safetensors"
    save_model(build_model(resolve_shape("tiny", {}, tok.vocab_size)), str(base))
    domain = tmp_path / "domain"
    shard_into([(two_sources.parent / "second", 1.0)], domain, seq_len=32, split=(90.0, 5.0, 5.0))
    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "c.yaml",
        run_dir=run_dir,
        shards=domain,
        ds_config="zero2.json",
        steps=12,
        ckpt_interval=12,
        model=f"{{preset: tiny, init_from: {base}}}",
    )
    out = launch.run(cfg, num_gpus=1, sets=("eval.interval=4",))
    assert out.returncode == 0, out.stderr[-3000:]
    result = evaluate_run(
        EvalConfig(
            checkpoint=str(run_dir),
            data=str(two_sources),
            baseline=True,
            needle="64,128",
            device="cpu",
            max_new_tokens=0,
            batch_size=4,
        )
    )
    return run_dir, result


def test_a_continuation_on_a_domain_is_compared_with_its_base_by_source_over_the_same_samples(
    continued: tuple[Path, dict], tmp_path: Path, two_sources: Path
) -> None:
    """`pipeline evaluate --baseline --data BLEND` on a model continued on one source of the blend evaluates the
    base on exactly the samples the continued model was evaluated on: both sources' losses for both models, and
    the change by source with its standard error: the domain's loss falls by far more than its noise; the needle
    at two lengths for both models. A run without init_from is one line."""
    from pipeline.evaluate.run import table

    _, result = continued
    # the needle at two lengths, for both models, on the same prompts
    for found in (result["needle"], result["baseline"]["needle"]):
        assert [(b["length"], b["prompts"]) for b in found["by_length"]] == [(64, 3), (128, 3)]
        assert all(0.0 <= b["found"] <= 1.0 and b["answer_loss"] > 0 for b in found["by_length"])
    assert [s["source"] for s in result["by_source"]] == ["first", "second"]
    assert [s["source"] for s in result["baseline"]["by_source"]] == ["first", "second"]
    change = {c["source"]: c for c in result["change"]}
    assert set(change) == {"total", "first", "second"}
    assert change["second"]["samples"] + change["first"]["samples"] == change["total"]["samples"]
    base_loss = {s["source"]: s["loss"] for s in result["baseline"]["by_source"]}
    for s in result["by_source"]:  # the change is the continued model's loss less the base's, on the same tokens
        assert change[s["source"]]["loss_change"] == pytest.approx(s["loss"] - base_loss[s["source"]], abs=1e-9)
    domain_change = change["second"]
    assert domain_change["loss_change"] < -4 * domain_change["stderr"] < 0, domain_change
    assert change["first"]["stderr"] > 0
    shown = table(result)
    assert "change from base" in shown and "second: -" in shown and "± one standard error" in shown
    assert "needle" in shown and "base's needle" in shown and "128: found " in shown
    # no base to compare with: one line, before any weight is read
    r = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(launch_plain(tmp_path, two_sources)), "--baseline"])
    assert r.exit_code == 2 and "has no model.init_from in its config: it trained from scratch" in r.output


def test_the_run_report_opens_offline_in_a_browser_with_every_plot_drawn_and_the_jsons_numbers(
    continued: tuple[Path, dict], tmp_path: Path
) -> None:
    """`pipeline report RUN_DIR` on the continued run: one HTML page, checked in a real Chromium (Debian's, driven
    by Playwright; .ci/run installs it): it loads from a file with no console error and no request beyond it, every
    plot the JSON lists is drawn (not blank), and each number shown is the JSON's at the precision shown. Not a run
    folder: one line."""
    import io

    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra: make install")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does this)")
    from PIL import Image

    run_dir, _ = continued
    r = CliRunner().invoke(main, ["report", str(run_dir)])
    assert r.exit_code == 0, r.output
    page_path, data = run_dir / "report.html", json.loads((run_dir / "report.json").read_text())
    assert data["plots"] == ["loss", "learning_rate", "throughput"]  # no MFU on a CPU
    assert "val_loss/second" not in data["curves"]  # the run's own shards have one source
    assert len(data["evaluations"]) == 1 and data["evaluations"][0]["baseline"]["needle"]
    flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking"]
    flags += ["--disable-component-update", "--disable-sync"]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=flags)
        page = browser.new_page()
        errors: list[str] = []
        requests: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda q: requests.append(q.url))
        page.goto(page_path.as_uri())
        figures = page.query_selector_all("figure.plot")
        assert [f.get_attribute("data-plot") for f in figures] == data["plots"]
        for f in figures:
            image = Image.open(io.BytesIO(f.screenshot())).convert("L")
            inked = sum(1 for v in image.tobytes() if v < 200)
            assert inked > 0.01 * image.width * image.height, f.get_attribute("data-plot")
        cells = page.query_selector_all("td.num")
        assert len(cells) > 20
        for cell in cells:
            value: object = data
            for part in (cell.get_attribute("data-key") or "").split("."):
                value = value[int(part)] if isinstance(value, list) else value[part]  # type: ignore[index]
            shown = cell.inner_text().replace(",", "")
            digits = len(shown.split(".")[1]) if "." in shown else 0
            assert float(shown) == pytest.approx(value, abs=0.51 * 10**-digits), (cell.get_attribute("data-key"), shown)
        browser.close()
    assert not errors, errors
    assert requests == [page_path.as_uri()], requests
    r = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert r.exit_code == 2 and "no metrics.jsonl: not a training run folder" in r.output


def launch_plain(tmp_path: Path, shards: Path) -> Path:
    """A 2-step run from scratch (no init_from)."""
    run_dir = tmp_path / "scratch"
    cfg = launch.write_config(
        tmp_path / "s.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", steps=2, ckpt_interval=2
    )
    out = launch.run(cfg, num_gpus=1)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir
