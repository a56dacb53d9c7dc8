"""Tiny random Hugging Face models of each supported family, built and saved locally (no downloads), with a
byte-level BPE tokenizer trained here: what a user's downloaded model folder looks like, at toy size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import CORPUS

VOCAB = 640
"""The models' embedding rows: more than the tokenizer's 600 tokens, as Qwen2.5 pads its embedding."""

COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.2,
    "hidden_act": "silu",
}

CONFIGS: dict[str, dict] = {
    # config.json as Llama-3.1 ships it (rope_scaling, rope_theta at the top level), not as transformers 5 saves it.
    "llama": {
        **COMMON,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "mistral": {
        **COMMON,
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "rope_theta": 1e6,
        "sliding_window": 4096,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen2": {
        **COMMON,
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "rope_theta": 1e6,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 2,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    "qwen3": {
        **COMMON,
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "rope_theta": 1e6,
        "head_dim": 32,
        "attention_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}
FAMILIES = tuple(CONFIGS)

MISTRAL_WINDOW_16 = {
    "model_type": "mistral",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 640,
    "max_position_embeddings": 256,
    "sliding_window": 16,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
"""A tiny Mistral-7B-v0.1 config.json with its sliding window at a quarter of a 64-token sample (fresh weights:
model.architecture), over the test tokenizers' ids."""


def write_tokenizer(out: Path, split: str | None = None, bos: bool = False) -> Path:
    """A 600-token byte-level BPE with <unk> <s> </s> as ids 0, 1, 2, saved as a transformers tokenizer folder.
    `split`: the expression text is split with before the bytes are mapped, as Llama 3's and Qwen2's tokenizers
    do (None: ByteLevel's own, GPT-2's); `bos`: <s> put before every text, as Llama 3's post-processor does."""
    from tokenizers import ByteLevelBPETokenizer, Regex, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines() if line.strip()]
    specials = ["<unk>", "<s>", "</s>"]
    if split is None:
        bpe: Any = ByteLevelBPETokenizer()
        bpe.train_from_iterator(texts, vocab_size=600, special_tokens=specials)
    else:
        bpe = RawTokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), "isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
        )
        bpe.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        bpe.train_from_iterator(
            texts, trainers.BpeTrainer(vocab_size=600, special_tokens=specials, initial_alphabet=alphabet)
        )
    if bos:
        bpe.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        str(out)
    )
    return out


def write_model(family: str, out: Path, tokenizer: Path, seed: int = 0, **changes: Any) -> Path:
    """A random model of `family` saved as its hub folder would be: config.json in the hub's form, safetensors
    weights (sharded in two files, with an index), and the tokenizer's files; `changes` over the family's
    config.json."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {**CONFIGS[family], **changes}
    torch.manual_seed(seed)
    config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(out), max_shard_size="60KB")
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    for f in tokenizer.iterdir():
        shutil.copyfile(f, out / f.name)
    return out
