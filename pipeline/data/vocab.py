"""Vocabulary extension for continuing a Hugging Face model on a new language (`pipeline extend-vocab`).

A model's tokenizer spends several tokens per character on a script it saw little of (Llama's on Thai or
Amharic), so its context holds a fraction of the text and training pays for every extra token. Here:
  1. a sentencepiece BPE is trained on a seeded sample of the new corpus (the pipeline's own trainer);
  2. its pieces that the model's tokenizer does not already hold as one token are added to it, most frequent
     first (transformers' added tokens, matched on the raw text before the model's own pre-tokenisation);
  3. the embedding and output rows of the new ids are drawn around the old rows' mean with their covariance (what
     transformers' `resize_token_embeddings(mean_resizing=True)` does), every old row unchanged, so the logits of
     text made of old tokens do not move;
  4. the new model folder is written file by file in the source's sharding (one safetensors file in RAM at a
     time), with its config's vocab_size, the extended tokenizer, and `vocab_extension.json`: the pieces added
     and the bytes per token before and after on held-out documents of the corpus.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.atomic import replacing_dir, write_json
from pipeline.data.config import VocabConfig
from pipeline.data.readers import read_records, resolve_inputs
from pipeline.data.tokenizer import RARE, train_sentencepiece
from pipeline.errors import PipelineError, writing_into
from pipeline.model.families import model_folder_problems

log = logging.getLogger(__name__)
EMBEDDING_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
"""The rows indexed by token id in the families we continue (pipeline.model.families)."""
RESULT = "vocab_extension.json"


@dataclass(frozen=True, slots=True)
class VocabResult:
    output: Path
    added: int
    bytes_per_token_before: float
    bytes_per_token_after: float
    notes: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        gain = self.bytes_per_token_after / self.bytes_per_token_before
        return "\n".join(
            [
                f"wrote {self.output}: {self.added:,} tokens added; held-out text at {self.bytes_per_token_before:.2f}"
                f" bytes per token before, {self.bytes_per_token_after:.2f} after ({gain:.2f}x as many bytes per "
                f"token); continue it with model.init_from: {self.output}, and tokenize with --tokenizer {self.output}",
                *(f"note: {n}" for n in self.notes),
            ]
        )


def rare_added(tok: Any, docs: list[str], first_id: int, added: int, asked: int) -> list[str]:
    """A note when most of the added tokens occur fewer than RARE times in the sampled documents (a --new-tokens of
    100,000 on a few hundred documents): their embedding rows would barely train, as tokenize says of a
    --vocab-size the text does not support."""
    import numpy as np

    if not added:
        return []
    counts = np.zeros(added, dtype=np.int64)
    for d in docs:
        ids = np.asarray(tok.encode(d, add_special_tokens=False), dtype=np.int64)
        new = ids[(ids >= first_id) & (ids < first_id + added)] - first_id
        counts += np.bincount(new, minlength=added)[:added]
    rare = int((counts < RARE).sum())
    if rare <= added // 2:
        return []
    return [
        f"--new-tokens {asked:,}: {rare:,} of the {added:,} added tokens occur fewer than {RARE} times in the "
        f"{len(docs):,} documents sampled, so their embedding rows will barely train; a smaller --new-tokens (or "
        "more text) suits this corpus"
    ]


def _documents(cfg: VocabConfig) -> tuple[list[str], list[str]]:
    """(training sample, held-out documents): a seeded reservoir sample of the valid documents, the held-out ones
    drawn out of it first."""
    rng = random.Random(cfg.seed)
    want = cfg.sample_docs + cfg.held_out_docs
    sample: list[str] = []
    seen = 0
    for src in resolve_inputs(list(cfg.inputs)):
        for rec in read_records(src, cfg.text_key):
            if rec.text is None or not rec.text.strip():
                continue
            if seen < want:
                sample.append(rec.text)
            elif (j := rng.randrange(seen + 1)) < want:
                sample[j] = rec.text
            seen += 1
    rng.shuffle(sample)
    held = min(cfg.held_out_docs, len(sample) // 10)
    if held < 1:
        raise PipelineError(f"{', '.join(cfg.inputs)}: {seen} documents; extending a vocabulary needs 10 or more")
    return sample[held:], sample[:held]


def _candidate_pieces(docs: list[str], size: int, seed: int) -> list[str]:
    """The pieces of a sentencepiece BPE trained on `docs`, most frequent merges first, as the text they stand
    for (no byte or control pieces)."""
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        path = train_sentencepiece(docs, Path(tmp) / "new.model", vocab_size=size, seed=seed)
        sp = spm.SentencePieceProcessor(model_file=str(path))
        pieces = [
            (sp.get_score(i), sp.id_to_piece(i))
            for i in range(sp.get_piece_size())
            if not (sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i))
        ]
    return [p.replace("\u2581", " ") for _, p in sorted(pieces, key=lambda x: -x[0]) if len(p) > 1]


def _bytes_per_token(tok: Any, docs: list[str]) -> float:
    tokens = sum(len(tok.encode(d, add_special_tokens=False)) for d in docs)
    return sum(len(d.encode("utf-8")) for d in docs) / max(tokens, 1)


def new_rows(old: Any, count: int, seed: int) -> Any:
    """`count` rows drawn from a normal distribution with the mean of `old`'s rows and 1e-9 times their covariance
    (transformers' mean resizing: close to the mean, so a new token's logit starts near the average one and no
    old token's probability is disturbed much); the mean itself when the covariance is not positive definite."""
    import torch

    rows = old.float()
    mean = rows.mean(0)
    centred = rows - mean
    cov = centred.T @ centred / rows.shape[0]
    gen = torch.Generator().manual_seed(seed)
    if bool((torch.linalg.eigvalsh(cov) > 0).all()):
        chol = torch.linalg.cholesky(1e-9 * cov)
        noise = torch.randn(count, rows.shape[1], generator=gen) @ chol.T
        return (mean + noise).to(old.dtype)
    return mean.expand(count, -1).clone().to(old.dtype)


def _resized(name: str, tensor: Any, keep: int, rows: int, seed: int) -> Any:
    """An embedding or output matrix with rows [keep, rows) drawn anew (`new_rows`), rows [0, keep) as they were."""
    import torch

    fresh = new_rows(tensor[:keep], rows - keep, seed + EMBEDDING_NAMES.index(name))
    return torch.cat([tensor[:keep], fresh]).contiguous()


def _write_weights(model_dir: Path, work: Path, keep: int, rows: int, seed: int) -> None:
    """Each safetensors file of the model, in its own name and dtype, with the embedding and output matrices
    resized to `rows`; the index's sizes recomputed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise PipelineError(f"{model_dir}: no safetensors weights; extend-vocab reads Hugging Face model folders")
    resized = set()
    for f in files:
        tensors = {}
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = handle.get_tensor(name)
                if name in EMBEDDING_NAMES:
                    t = _resized(name, t, keep, rows, seed)
                    resized.add(name)
                tensors[name] = t
        save_file(tensors, str(work / f.name), metadata={"format": "pt"})
    if "model.embed_tokens.weight" not in resized:
        raise PipelineError(f"{model_dir}: no model.embed_tokens.weight; not a Llama/Mistral/Qwen model folder")
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = sum((work / f.name).stat().st_size for f in files)
        (work / index.name).write_text(json.dumps(data, indent=2))


def extend_vocabulary(cfg: VocabConfig) -> VocabResult:
    """`pipeline extend-vocab`: the model folder with its tokenizer extended for the corpus (see the module)."""
    from transformers import AddedToken, AutoTokenizer

    model_dir, output = Path(cfg.model_dir), Path(cfg.output)
    if not (model_dir / "config.json").is_file():
        raise PipelineError(f"{model_dir}: no config.json; give a downloaded Hugging Face model folder")
    if found := model_folder_problems(model_dir, "MODEL_DIR", weights=True, tokenizer=True):
        raise PipelineError("; ".join(found))
    if output.resolve() == model_dir.resolve():
        raise PipelineError(f"--output {output}: the model folder itself; give a new folder")
    if output.exists() and any(output.iterdir()) and not (output / RESULT).exists():
        raise PipelineError(f"--output {output}: a folder holding other files; give a new or empty folder")
    config = json.loads((model_dir / "config.json").read_text())
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise PipelineError(f"{model_dir}: cannot load its tokenizer ({type(e).__name__}: {e})") from None
    train, held = _documents(cfg)
    before = _bytes_per_token(tok, held)
    known = set(tok.get_vocab())
    pieces = []
    for piece in _candidate_pieces(train, min(cfg.new_tokens * 2 + 300, 1_000_000), cfg.seed):
        if piece not in known and len(tok.encode(piece, add_special_tokens=False)) > 1:
            pieces.append(piece)
            known.add(piece)
        if len(pieces) == cfg.new_tokens:
            break
    old_len = len(tok)
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in pieces])
    after = _bytes_per_token(tok, held)
    rows = max(int(config["vocab_size"]), len(tok))
    log.info("extend-vocab: %d pieces added; embedding rows %d -> %d", len(pieces), config["vocab_size"], rows)
    with writing_into(output), replacing_dir(output, "another `pipeline extend-vocab`") as work:
        _write_weights(model_dir, work, min(old_len, int(config["vocab_size"])), rows, cfg.seed)
        (work / "config.json").write_text(json.dumps({**config, "vocab_size": rows}, indent=2))
        if (model_dir / "generation_config.json").is_file():
            shutil.copyfile(model_dir / "generation_config.json", work / "generation_config.json")
        tok.save_pretrained(str(work))
        write_json(
            work / RESULT,
            {
                "source": str(model_dir.resolve()),
                "inputs": list(cfg.inputs),
                "added_tokens": len(pieces),
                "first_id": old_len,
                "vocab_size": {"before": int(config["vocab_size"]), "after": rows},
                "held_out_documents": len(held),
                "bytes_per_token": {"before": round(before, 4), "after": round(after, 4)},
                "seed": cfg.seed,
                "pieces": pieces,
            },
        )
    notes = rare_added(tok, train, old_len, len(pieces), cfg.new_tokens)
    return VocabResult(output, len(pieces), before, after, tuple(notes))
