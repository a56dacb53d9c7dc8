"""Tokenizers: train a sentencepiece model on a corpus sample, or load a sentencepiece / Hugging Face one.

Special ids are fixed for trained models: <unk>=0, <s>=1, </s>=2, <pad>=3. Normalisation is the identity and
whitespace is kept as is, so `decode(encode(text)) == text` for ordinary text; byte fallback means no <unk>.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.manifest import TokenizerInfo
from pipeline.errors import PipelineError
from pipeline.model import ModelShape

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
_MAX_SENTENCE_BYTES = 16384


class Tokenizer:
    """A loaded tokenizer with the few calls the pipeline needs. Picklable by path: workers reload it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise PipelineError(f"{self.path}: tokenizer not found")
        self.kind = "hf" if self.path.is_dir() else "sentencepiece"
        try:
            if self.kind == "sentencepiece":
                import sentencepiece as spm

                self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
                self.vocab_size = self._sp.get_piece_size()
                self.eos_id = self._sp.eos_id()
                self.bos_id = self._sp.bos_id()
                self.pad_id = self._sp.pad_id()
            else:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
                self.vocab_size = len(self._hf)
                self.eos_id = self._hf.eos_token_id if self._hf.eos_token_id is not None else -1
                self.bos_id = self._hf.bos_token_id if self._hf.bos_token_id is not None else -1
                self.pad_id = self._hf.pad_token_id if self._hf.pad_token_id is not None else -1
        except PipelineError:
            raise
        except Exception as e:  # sentencepiece raises RuntimeError/OSError; transformers many kinds
            raise PipelineError(f"{self.path}: cannot load tokenizer ({type(e).__name__}: {e})") from None
        if self.eos_id < 0:
            raise PipelineError(f"{self.path}: tokenizer has no end-of-sequence token; documents need one")

    def __getstate__(self) -> dict:
        return {"path": str(self.path)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Ids of each text, no special tokens; one thread (parallelism is the caller's, by processes)."""
        if self.kind == "sentencepiece":
            return self._sp.encode(texts, return_type="numpy", num_threads=1)
        return [np.asarray(self._hf.encode(t, add_special_tokens=False), dtype=np.int64) for t in texts]

    def encode(self, text: str) -> list[int]:
        return [int(x) for x in self.encode_batch([text])[0]]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "sentencepiece":
            return str(self._sp.decode(ids))
        return str(self._hf.decode(ids))

    def sha256(self) -> str:
        return tokenizer_sha256(self.path)


def tokenizer_sha256(path: Path) -> str:
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _sentences(docs: Iterable[str]) -> Iterator[str]:
    # sentencepiece learns from "sentences"; lines of a document are the natural unit. Longer lines are cut
    # so that none is silently skipped by the trainer's max_sentence_length.
    for doc in docs:
        for line in doc.split("\n"):
            if not line.strip():
                continue
            b = line.encode("utf-8")
            while len(b) > _MAX_SENTENCE_BYTES:
                cut = _MAX_SENTENCE_BYTES
                while cut > 0 and (b[cut] & 0xC0) == 0x80:  # never split a UTF-8 sequence
                    cut -= 1
                yield b[:cut].decode("utf-8")
                b = b[cut:]
            yield b.decode("utf-8")


def train_sentencepiece(
    docs: list[str], output: Path, *, vocab_size: int, model_type: str = "bpe", seed: int = 1234, threads: int = 1
) -> Path:
    """Train on `docs` and write `output` (a .model file) atomically. Deterministic for the same docs and seed."""
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise PipelineError(f"--model-type {model_type}: expected bpe or unigram")
    if not docs:
        raise PipelineError("no valid documents to train a tokenizer on")
    spm.set_random_generator_seed(seed)
    tmp_prefix = output.with_name(f".{output.name}.{os.getpid()}")
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(docs),
            model_prefix=str(tmp_prefix),
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            split_digits=True,
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            character_coverage=0.9995,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            max_sentence_length=_MAX_SENTENCE_BYTES,
            input_sentence_size=2_000_000,
            shuffle_input_sentence=True,
            hard_vocab_limit=False,
            num_threads=max(1, threads),
            minloglevel=2,
        )
    except RuntimeError as e:
        raise PipelineError(f"sentencepiece training failed: {e}. A smaller --vocab-size or more text helps") from None
    finally:
        Path(str(tmp_prefix) + ".vocab").unlink(missing_ok=True)
    os.replace(str(tmp_prefix) + ".model", output)
    return output


RARE = 10
"""Occurrences under which a piece's embedding barely trains."""


def vocabulary_notes(counts: Any, asked: int) -> list[str]:
    """A note when the trained tokenizer has more pieces than the text supports: most of them occur fewer than RARE
    times in the tokenized corpus (a --vocab-size of 100,000 on a few thousand documents)."""
    rare = int((counts < RARE).sum())
    if rare <= len(counts) // 2:
        return []
    return [
        f"--vocab-size {asked:,}: {rare:,} of the tokenizer's {len(counts):,} pieces occur fewer than {RARE} times "
        f"in these {int(counts.sum()):,} tokens, so their embeddings will barely train; a smaller --vocab-size "
        "(or more text) suits this corpus"
    ]


def check_tokenizer(shape: ModelShape, tok: TokenizerInfo, source: str) -> None:
    """Refuse data tokenized with a tokenizer that is not the model's: ids past the model's vocabulary, different
    end/begin-of-sequence ids, or (when the model folder carries a tokenizer) a different vocabulary size. `source`
    names where the data's tokenizer was read (a shard manifest)."""
    if shape.hf_config is None:
        return
    cfg = shape.hf_config
    model = cfg.get("_name_or_path") or "the model"
    problems = []
    if tok["vocab_size"] > shape.vocab_size:
        problems.append(f"its vocabulary has {tok['vocab_size']:,} tokens, the model's embedding {shape.vocab_size:,}")
    eos = cfg.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if eos_ids and tok["eos_id"] not in eos_ids:
        problems.append(f"its end-of-sequence id is {tok['eos_id']}, the model's {eos}")
    bos = cfg.get("bos_token_id")
    if isinstance(bos, int) and tok.get("bos_id", -1) >= 0 and tok["bos_id"] != bos:
        problems.append(f"its begin-of-sequence id is {tok['bos_id']}, the model's {bos}")
    own = _model_tokenizer_size(cfg)
    if own is not None and own != tok["vocab_size"]:
        problems.append(f"it has {tok['vocab_size']:,} tokens, the model folder's own tokenizer {own:,}")
    if problems:
        raise PipelineError(
            f"{source}: the data was tokenized with {tok.get('path')}, which is not the tokenizer of "
            f"{model}: " + "; ".join(problems) + ". Re-tokenize with `pipeline tokenize --tokenizer "
            "MODEL_DIR` (the model's own tokenizer)"
        )


def _model_tokenizer_size(cfg: dict[str, Any]) -> int | None:
    folder = cfg.get("_name_or_path")
    if not folder or not Path(folder, "tokenizer_config.json").is_file():
        return None
    try:
        return Tokenizer(folder).vocab_size
    except PipelineError:
        return None


def check_model_tokenizer(model_dir: str, prefixes: list[str]) -> None:
    """`pipeline shard --model DIR`: refuse tokenized data whose tokenizer is not that Hugging Face model's (each
    prefix's manifest names the tokenizer it was encoded with)."""
    from pipeline.data.manifest import read_tokenize_manifest
    from pipeline.model import families

    model = families.shape_from_config(families.read_config(model_dir), model_dir)
    for prefix in prefixes:
        check_tokenizer(model, read_tokenize_manifest(prefix)["tokenizer"], f"{prefix}.manifest.json")
