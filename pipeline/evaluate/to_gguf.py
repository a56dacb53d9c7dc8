"""A Hugging Face export -> one GGUF file that llama.cpp and Ollama run (`pipeline export --gguf f16|q8_0`).

Written with `gguf`, llama.cpp's own Python package: its writer, its tensor-name map, its q8_0 quantiser and its
sentencepiece vocabulary reader; what is ours is the little llama.cpp's convert_hf_to_gguf.py does per family and
the package leaves to it: the metadata keys, and the Llama-architecture q/k rows reordered for llama.cpp's RoPE
(Llama and Mistral; Qwen2/Qwen3 use the rotation transformers uses). Tokenizers: sentencepiece ones (this
project's, Llama 2's, Mistral's) and byte-level BPE ones (Llama 3, Qwen2/2.5/3, GPT-2's), whose pre-tokenizer
llama.cpp knows by name: the name is read off the tokenizer's own split expression (`PRE_TOKENIZERS`), and one it
does not list is refused with the way out (llama.cpp's converter, which knows more by hashing their output)."""

from __future__ import annotations

import json
import logging
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


ROPE_CARRIED = ("default", "llama3", "yarn", "linear")
"""RoPE variants the conversion carries: plain (any theta); Llama 3.1's frequency scaling (a per-frequency
divisor, llama.cpp's rope_freqs tensor; Llama and Mistral); YaRN with transformers' defaults (beta 32 and 1, the
attention scale 0.1 ln(factor) + 1, which llama.cpp computes the same way) and linear (positions / factor), as
llama.cpp's own scaling types. Others (YaRN with its own betas or attention factor, dynamic, longrope) are refused
with the way out."""
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "mscale": None, "mscale_all_dim": None}


def rope_scaling(config: dict[str, Any], family: str, hf_dir: Path) -> str:
    """The one RoPE variant of a config.json (rope_parameters as transformers 5 writes it, rope_scaling as
    transformers 4 and the hub do; both must agree), refused where the conversion does not carry it."""
    _, rope = rope_of(config)
    kinds = [
        str(r.get("rope_type") or r.get("type") or "default")
        for r in (config.get("rope_parameters"), config.get("rope_scaling"))
        if r
    ] or ["default"]
    kind = kinds[0]
    odd = {k: rope[k] for k, v in YARN_DEFAULTS.items() if kind == "yarn" and rope.get(k) not in (None, v)}
    if len(set(kinds)) > 1:
        raise PipelineError(
            f"--gguf: {hf_dir}/config.json: rope_parameters ({kinds[0]}) and rope_scaling ({kinds[1]}) disagree; "
            "keep the one the model was trained with"
        )
    if kind not in ROPE_CARRIED or odd or (kind == "llama3" and family not in PERMUTED):
        raise PipelineError(
            f"--gguf: {hf_dir}/config.json scales RoPE as {config.get('rope_scaling') or rope}, which this "
            f"conversion does not carry yet (it carries {', '.join(ROPE_CARRIED)}; YaRN with transformers' "
            "defaults); convert the Hugging Face export with llama.cpp's convert_hf_to_gguf.py"
        )
    return kind


def rope_of(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """RoPE's base and parameters from a config.json as transformers 5 writes it (rope_parameters) or as
    transformers 4 and the hub's files do (rope_theta, rope_scaling)."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    theta = rope.get("rope_theta") or config.get("rope_theta") or 10000.0
    return float(theta), rope


def rope_factors(hf_dir: Path, theta: float) -> np.ndarray:
    """Llama 3.1's RoPE as llama.cpp takes it: what each of plain RoPE's frequencies is divided by, from the
    frequencies transformers' own llama3 function gives for the export's config."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.from_pretrained(str(hf_dir))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    dim = 2 * scaled.numel()
    plain = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return (plain / scaled.double()).float().numpy()


def _bpe_problem(doc: dict[str, Any], file: Path) -> str | None:
    """Why a tokenizer.json is not one this conversion carries (None: a byte-level BPE with a known pre-tokenizer)."""
    model = doc.get("model") or {}
    decoder = (doc.get("decoder") or {}).get("type")
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder != "ByteLevel":
        return (
            f"--gguf: {file} is not a byte-level BPE tokenizer (model {model.get('type')}, decoder {decoder}) and "
            "the run has no sentencepiece tokenizer.model; convert the export with llama.cpp's convert_hf_to_gguf.py"
        )
    if not PRE_TOKENIZERS.get(_split_expression(doc.get("pre_tokenizer")), ""):
        return (
            f"--gguf: {file}: its pre-tokenizer is none that this conversion names for llama.cpp (Llama 3's, "
            "Qwen2's, GPT-2's); convert the export with llama.cpp's convert_hf_to_gguf.py, which knows more"
        )
    return None


def tokenizer_problem(tokenizer: Path | None) -> str | None:
    """Why --gguf cannot carry the run's tokenizer (a sentencepiece model file, or a Hugging Face tokenizer
    folder), None when it can: asked before the export's minutes, so nothing is written for a refusal."""
    if tokenizer is None:
        return "--gguf: the run's shards name no tokenizer to carry into the GGUF file"
    if tokenizer.is_file() or (tokenizer / "tokenizer.model").is_file():
        return None
    file = tokenizer / "tokenizer.json"
    if not file.is_file():
        return f"--gguf: {tokenizer} has neither a sentencepiece tokenizer.model nor a tokenizer.json"
    return _bpe_problem(json.loads(file.read_text()), file)


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
    theta, rope = rope_of(config)
    scaling = rope_scaling(config, family, hf_dir)
    arch = getattr(gguf.MODEL_ARCH, ARCHES[family])
    tmp = tmp_path_for(out)  # written whole, then renamed: a half-written .gguf never has the final name
    try:
        writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
        _metadata(writer, gguf, config, kind, hf_dir)
        _rope_metadata(writer, gguf, config, theta, rope, scaling)
        _vocabulary(writer, gguf, hf_dir, config)
        _tensors(writer, gguf, hf_dir, config, arch, family, kind)
        if scaling == "llama3":
            writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_factors(hf_dir, theta))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _rope_metadata(
    writer: Any, gguf: Any, config: dict[str, Any], theta: float, rope: dict[str, Any], scaling: str
) -> None:
    """RoPE's base and, for YaRN and linear scaling, llama.cpp's own scaling type with its factor (and YaRN's
    original context): llama.cpp then computes the frequencies and YaRN's attention scale as transformers does."""
    writer.add_rope_freq_base(theta)
    if scaling in ("yarn", "linear"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN if scaling == "yarn" else gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if scaling == "yarn":
        original = rope.get("original_max_position_embeddings") or config["max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(int(original))


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
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if kind == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0)


LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2", None: "gpt-2"}
"""A byte-level BPE tokenizer's split expression (tokenizer.json's Split pre-tokenizer before its ByteLevel; None:
ByteLevel's own, GPT-2's) -> the name llama.cpp gives that pre-tokenizer (tokenizer.ggml.pre): Llama 3 and 3.1's,
Qwen2's (also Qwen2.5's and Qwen3's), GPT-2's (a ByteLevelBPETokenizer's, as trained by `tokenizers`)."""


def _vocabulary(writer: Any, gguf: Any, hf_dir: Path, config: dict[str, Any]) -> int:
    """The tokenizer's vocabulary, padded to the embedding's rows as llama.cpp's converter pads it; its special
    ids from the export's files. Returns the token count."""
    if not (hf_dir / "tokenizer.model").exists():
        if not (hf_dir / "tokenizer.json").exists():
            raise PipelineError(
                f"--gguf: {hf_dir} has neither a sentencepiece tokenizer.model nor a tokenizer.json; export the run "
                "with its tokenizer"
            )
        return _bpe_vocabulary(writer, gguf, hf_dir, config["vocab_size"])
    from gguf.vocab import SentencePieceVocab

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
    _specials(writer, hf_dir, rows, merges=False)
    return rows


def _bpe_vocabulary(writer: Any, gguf: Any, hf_dir: Path, rows: int) -> int:
    """A byte-level BPE tokenizer (tokenizer.json) as llama.cpp's "gpt2" tokenizer model: every id's token as the
    file spells it (bytes mapped to characters), added tokens marked control (special) or user-defined, rows past
    the vocabulary as unused padding; the merges, special ids and whether a begin-of-sequence id is put before the
    text, as transformers' tokenizer of the export does."""
    file = hf_dir / "tokenizer.json"
    doc = json.loads(file.read_text())
    model = doc.get("model") or {}
    if problem := _bpe_problem(doc, file):
        raise PipelineError(problem)
    pre = PRE_TOKENIZERS[_split_expression(doc.get("pre_tokenizer"))]
    ids: dict[int, tuple[str, Any]] = {i: (t, gguf.TokenType.NORMAL) for t, i in model["vocab"].items()}
    for added in doc.get("added_tokens") or []:
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        ids[added["id"]] = (added["content"], kind)
    if max(ids) >= rows:
        raise PipelineError(f"--gguf: {file} has ids up to {max(ids)}, the model's embedding {rows} rows")
    tokens = [ids[i][0] if i in ids else f"[PAD{i}]" for i in range(rows)]
    types = [ids[i][1] if i in ids else gguf.TokenType.UNUSED for i in range(rows)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    _specials(writer, hf_dir, rows, merges=True)
    return rows


def _specials(writer: Any, hf_dir: Path, rows: int, merges: bool) -> None:
    """The special ids (and a BPE's merges) from the export's tokenizer files, and whether llama.cpp puts a
    begin-of-sequence id before the text and an end-of-sequence id after it: as transformers' tokenizer of the
    export does (written always: llama.cpp's default for a file that does not say is to put one first, which this
    project's models never saw)."""
    from gguf.vocab import SpecialVocab

    vocab_log = logging.getLogger("gguf.vocab")
    level = vocab_log.level
    vocab_log.setLevel(logging.ERROR)  # its guesses at pair templates: not ours to show
    try:
        special = SpecialVocab(hf_dir, load_merges=merges, n_vocab=rows)
    finally:
        vocab_log.setLevel(level)
    special.add_special_token["bos"], special.add_special_token["eos"] = _adds_bos_eos(hf_dir)
    special.add_to_gguf(writer, quiet=True)


def _split_expression(pre: dict[str, Any] | None) -> str | None:
    """The expression a byte-level BPE pre-tokenizer splits text with before mapping bytes: a Split's regex
    followed by a ByteLevel that does not split again, or None for a ByteLevel that splits as GPT-2 does; "" for
    anything else."""
    pre = pre or {}
    steps: list[dict[str, Any]] = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space"):
        return None
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        return str((steps[0].get("pattern") or {}).get("Regex", ""))
    return ""


def _adds_bos_eos(hf_dir: Path) -> tuple[bool, bool]:
    """Whether transformers' tokenizer of the export puts the begin-of-sequence id before a text and the
    end-of-sequence id after it (llama.cpp reads both from the file)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    except Exception as e:  # whatever transformers raises for a folder it cannot read a tokenizer from
        raise PipelineError(
            f"--gguf: {hf_dir}: transformers cannot load its tokenizer ({type(e).__name__}: {e}); export the run "
            "with its tokenizer"
        ) from None
    bare = tok("a", add_special_tokens=False)["input_ids"]
    full = tok("a")["input_ids"]
    bos = tok.bos_token_id is not None and full[:1] == [tok.bos_token_id] and bare[:1] != full[:1]
    eos = tok.eos_token_id is not None and full[-1:] == [tok.eos_token_id] and bare[-1:] != full[-1:]
    return bos, eos


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
