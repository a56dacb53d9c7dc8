"""A Hugging Face export -> one GGUF file that llama.cpp and Ollama run (`pipeline export --gguf f16|q8_0`).

Written with `gguf`, llama.cpp's own Python package: its writer, its tensor-name map, its q8_0 quantiser and its
sentencepiece vocabulary reader; what is ours is the little llama.cpp's convert_hf_to_gguf.py does per family and
the package leaves to it: the metadata keys, and the Llama-architecture q/k rows reordered for llama.cpp's RoPE
(Llama and Mistral; Qwen2/Qwen3 use the rotation transformers uses). Tokenizers: sentencepiece ones (this
project's, Llama 2's, Mistral's); a byte-level BPE tokenizer (Llama 3, Qwen) is refused with the way out, since
llama.cpp identifies those by a table of pre-tokenizer hashes that lives in its converter only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.atomic import tmp_path_for
from pipeline.errors import PipelineError

GGUF_TYPES = ("f16", "q8_0")
NEEDED = "pip install gguf (llama.cpp's Python package; `pip install -e '.[gguf]'`)"
ARCHES = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}
"""transformers model_type -> gguf.MODEL_ARCH member (llama.cpp runs Mistral's dense models as llama)."""
PERMUTED = ("llama", "mistral")
"""Families whose q and k projections llama.cpp wants with each head's rotary pairs interleaved."""


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows from transformers' rotate-half order to the interleaved pairs llama.cpp's RoPE reads (what
    convert_hf_to_gguf.py's LlamaModel.permute does); transformers' GGUF loader undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise PipelineError(f"--gguf needs the gguf package: {NEEDED}") from None


def write_gguf(hf_dir: Path, out: Path, kind: str = "f16") -> Path:
    """Convert the Hugging Face folder `hf_dir` (config.json, safetensors, tokenizer.model) into `out`."""
    check_gguf()
    import gguf

    if kind not in GGUF_TYPES:
        raise PipelineError(f"--gguf {kind}: expected one of {', '.join(GGUF_TYPES)}")
    config = json.loads((hf_dir / "config.json").read_text())
    family = config.get("model_type", "llama")
    if family not in ARCHES:
        raise PipelineError(f"--gguf: no GGUF conversion here for model_type {family} (have {', '.join(ARCHES)})")
    if config.get("rope_scaling"):
        raise PipelineError(
            f"--gguf: {hf_dir}/config.json has rope_scaling {config['rope_scaling']}, which this conversion does "
            "not carry yet; convert the Hugging Face export with llama.cpp's convert_hf_to_gguf.py"
        )
    arch = getattr(gguf.MODEL_ARCH, ARCHES[family])
    tmp = tmp_path_for(out)  # written whole, then renamed: a half-written .gguf never has the final name
    try:
        writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
        _metadata(writer, gguf, config, kind, hf_dir)
        _vocabulary(writer, gguf, hf_dir, config)
        _tensors(writer, gguf, hf_dir, config, arch, family, kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _metadata(writer: Any, gguf: Any, config: dict[str, Any], kind: str, hf_dir: Path) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name(hf_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if kind == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0)


def _vocabulary(writer: Any, gguf: Any, hf_dir: Path, config: dict[str, Any]) -> int:
    """The sentencepiece vocabulary, padded to the embedding's rows as llama.cpp's converter pads it; its special
    ids from the export's files. Returns the token count."""
    if not (hf_dir / "tokenizer.model").exists():
        raise PipelineError(
            f"--gguf: {hf_dir} has no sentencepiece tokenizer.model (a byte-level BPE tokenizer, as Llama 3 and "
            "Qwen use, is identified by llama.cpp's converter only); convert this Hugging Face export with "
            "llama.cpp's convert_hf_to_gguf.py"
        )
    from gguf.vocab import SentencePieceVocab, SpecialVocab

    vocab = SentencePieceVocab(hf_dir)
    tokens, scores, types = [], [], []
    for text, score, toktype in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(toktype)
    rows = config["vocab_size"]
    if len(tokens) > rows:
        raise PipelineError(f"--gguf: the tokenizer has {len(tokens)} pieces, the model's embedding {rows} rows")
    for i in range(len(tokens), rows):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_add_space_prefix(_adds_dummy_prefix(vocab.fname_tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    SpecialVocab(hf_dir, n_vocab=rows).add_to_gguf(writer)
    return rows


def _adds_dummy_prefix(model_file: Path) -> bool:
    """Whether the sentencepiece model puts a space before the text (Llama 2's do; this project's do not): llama.cpp
    reads it from the GGUF (tokenizer.ggml.add_space_prefix, true when absent)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]
    proto.ParseFromString(model_file.read_bytes())
    return bool(proto.normalizer_spec.add_dummy_prefix)


def _tensors(writer: Any, gguf: Any, hf_dir: Path, config: dict[str, Any], arch: Any, family: str, kind: str) -> None:
    from gguf.quants import quantize
    from safetensors import safe_open

    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    files = sorted(hf_dir.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has no iteration of its own
                new = names.get_name(name, try_suffixes=(".weight", ".bias"))
                if new is None:
                    raise PipelineError(f"--gguf: {f.name}: no GGUF name for tensor {name}")
                data = st.get_tensor(name).float().numpy()
                if family in PERMUTED and name.endswith("q_proj.weight"):
                    data = permute(data, heads)
                elif family in PERMUTED and name.endswith("k_proj.weight"):
                    data = permute(data, kv_heads)
                if data.ndim == 1:  # norms and biases stay f32, as llama.cpp keeps them
                    writer.add_tensor(new, data.astype(np.float32))
                elif kind == "q8_0" and data.shape[-1] % 32 == 0:
                    q = quantize(data.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
                    writer.add_tensor(new, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                else:
                    writer.add_tensor(new, data.astype(np.float16))
