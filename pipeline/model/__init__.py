"""Model shapes, presets and the one model builder: transformers' LlamaForCausalLM (RoPE, SwiGLU, GQA, SDPA) for
our presets, the family's own class for a continued Hugging Face model (pipeline.model.families), each with a
chunked training loss. No distributed code."""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, replace
from typing import Any

from pipeline.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    hidden_size: int
    """Model width h."""
    num_layers: int
    ffn_hidden_size: int
    """SwiGLU inner width."""
    num_heads: int
    num_kv_heads: int
    """Grouped-query attention: key/value heads (== num_heads for plain multi-head attention)."""
    vocab_size: int = 32000
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    head_size: int | None = None
    """Per-head width when it is not hidden_size / num_heads (Qwen3, some Mistral models)."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on each head's queries and keys (Qwen3)."""
    rope: dict[str, Any] | None = None
    """RoPE parameters beyond rope_theta for our presets (transformers' names: rope_type, factor, ...); a Hugging
    Face model keeps its own in hf_config."""
    hf_config: dict[str, Any] | None = None
    """A Hugging Face model's config.json (continued pretraining, see pipeline.model.families): the model is built
    from it by transformers' own class for its `model_type`; the fields above are read from it for the planner."""

    def check(self) -> list[str]:
        p = []
        if self.head_size is None and self.hidden_size % self.num_heads:
            p.append(f"model.hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            p.append(f"model.num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if min(self.hidden_size, self.num_layers, self.ffn_hidden_size, self.num_heads, self.vocab_size) < 1:
            p.append("model sizes must be positive")
        return p

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def family(self) -> str:
        return str(self.hf_config["model_type"]) if self.hf_config else "llama"

    def layer_params(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        n = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h  # q, k, v, o, gate/up/down, two RMSNorms
        return n + (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)

    def mlp_params(self) -> int:
        """gate, up and down: the SwiGLU MLP's three matrices of one layer."""
        return 3 * self.hidden_size * self.ffn_hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        head = 0 if self.tie_embeddings else self.embedding_params()
        return self.embedding_params() + self.num_layers * self.layer_params() + self.hidden_size + head

    def largest_layer_params(self) -> int:
        """The largest single module (DeepSpeed's "largest layer"): the embedding or an MLP projection."""
        h, f = self.hidden_size, self.ffn_hidden_size
        return max(self.embedding_params(), h * f, h * h)

    def flops_per_token(self, seq_len: int, causal: bool = False) -> float:
        """Training FLOPs per token, PaLM appendix B: 6 N (non-embedding-input params) + 12 L H Q T attention, as
        TinyLlama and torchtitan count MFU. `causal` counts only the attention a causal mask leaves (half: 6 L H Q
        T)."""
        n = self.num_params() - self.embedding_params()
        attention = 12.0 * self.num_layers * self.num_heads * self.head_dim * seq_len
        return 6.0 * n + (attention / 2 if causal else attention)

    def tied_names(self) -> frozenset[str]:
        """Parameter names that are another parameter (the output head tied to the embedding): checkpoints list
        them, the model's parameters and exports do not."""
        return frozenset({"lm_head.weight"}) if self.tie_embeddings else frozenset()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line: the family and geometry (for logs and plans)."""
        name = self.hf_config.get("_name_or_path") if self.hf_config else None
        n = self.num_params()
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        return (
            f"{self.family}{f' ({name})' if name else ''}: {size} parameters, "
            f"{self.num_layers} layers, hidden {self.hidden_size}, heads {self.num_heads}/{self.num_kv_heads} kv, "
            f"vocab {self.vocab_size:,}"
        )


PRESETS: dict[str, ModelShape] = {
    # ~1M parameters with a small vocabulary: for tests and CPU demos.
    "tiny": ModelShape(
        hidden_size=64, num_layers=2, ffn_hidden_size=172, num_heads=4, num_kv_heads=2, max_seq_len=1024
    ),
    "125m": ModelShape(
        hidden_size=768, num_layers=12, ffn_hidden_size=2048, num_heads=12, num_kv_heads=12, max_seq_len=2048
    ),
    "350m": ModelShape(
        hidden_size=1024, num_layers=24, ffn_hidden_size=2816, num_heads=16, num_kv_heads=16, max_seq_len=2048
    ),
    # TinyLlama-1.1B geometry.
    "1b": ModelShape(
        hidden_size=2048, num_layers=22, ffn_hidden_size=5632, num_heads=32, num_kv_heads=4, max_seq_len=2048
    ),
    "7b": ModelShape(hidden_size=4096, num_layers=32, ffn_hidden_size=11008, num_heads=32, num_kv_heads=32),
    "13b": ModelShape(hidden_size=5120, num_layers=40, ffn_hidden_size=13824, num_heads=40, num_kv_heads=40),
    # Llama-2-70B geometry.
    "70b": ModelShape(hidden_size=8192, num_layers=80, ffn_hidden_size=28672, num_heads=64, num_kv_heads=8),
}


PRESET_GEOMETRY: dict[str, str] = {
    "1b": "TinyLlama-1.1B's geometry",
    "7b": "Llama-2-7B's geometry: 32K vocabulary, 4K native context",
    "13b": "Llama-2-13B's geometry: 32K vocabulary, 4K native context",
    "70b": "Llama-2-70B's geometry: 32K vocabulary, 4K native context; the 70B continued at long context today is "
    "Llama-3.1-70B (128K vocabulary and context): --model configs/hf/llama-3.1-70b.json",
}
"""What each preset is, said wherever a plan prints it: the presets are older models' shapes."""


def preset_note(shape: ModelShape) -> str | None:
    """'the 70b preset: Llama-2-70B's geometry ...' when `shape` is a preset's geometry (any vocabulary or
    length), else None."""
    geometry = ("hidden_size", "num_layers", "ffn_hidden_size", "num_heads", "num_kv_heads", "head_size")
    if shape.hf_config is not None:
        return None
    for name, note in PRESET_GEOMETRY.items():
        preset = PRESETS[name]
        if all(getattr(shape, k) == getattr(preset, k) for k in geometry):
            return f"the {name} preset: {note}"
    return None


def sequence_parallel_problems(shape: ModelShape, size: int) -> list[str]:
    """Why `size` ranks cannot share a sample of this model (empty when they can): Ulysses gives each rank
    heads / size query heads, and the key/value heads must split the same way or be replicated evenly."""
    if size == 1:
        return []
    found = []
    if shape.num_heads % size:
        found.append(
            f"train.sequence_parallel {size}: the model's {shape.num_heads} attention heads do not split over {size} "
            f"ranks; use one of {', '.join(str(n) for n in range(2, shape.num_heads + 1) if shape.num_heads % n == 0)}"
        )
    kv = shape.num_kv_heads
    if kv % size and size % kv:
        found.append(
            f"train.sequence_parallel {size}: the model's {kv} key/value heads neither split over {size} ranks nor "
            f"replicate evenly to them; use a size that divides {kv} or that {kv} divides"
        )
    return found


def resolve_shape(preset: str | None, overrides: dict[str, Any], vocab_size: int | None) -> ModelShape:
    """A preset (or explicit fields), with overrides such as num_layers=2, and the tokenizer's vocabulary."""
    if preset is not None and preset not in PRESETS:
        raise ConfigError([f"model.preset '{preset}': expected one of {', '.join(PRESETS)}"])
    fields = set(ModelShape.__dataclass_fields__) - {"hf_config", "qkv_bias", "qk_norm"}  # from a config.json only
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError([f"model.{k}: unknown field (known: {', '.join(sorted(fields))})" for k in unknown])
    try:
        shape = replace(PRESETS[preset], **overrides) if preset else ModelShape(**overrides)
    except TypeError as e:
        raise ConfigError(
            [f"model: give a preset or all of hidden_size, num_layers, ffn_hidden_size, num_heads, num_kv_heads ({e})"]
        ) from None
    if vocab_size is not None:
        shape = replace(shape, vocab_size=vocab_size)
    if problems := shape.check():
        raise ConfigError(problems)
    return shape


def with_seq_len(shape: ModelShape, seq_len: int) -> ModelShape:
    """`shape` with `max_seq_len` raised to `seq_len` when that is longer: RoPE extends to any length, so a model
    trained (or continued) at a longer context than its preset names is the same model with a larger table."""
    return replace(shape, max_seq_len=seq_len) if seq_len > shape.max_seq_len else shape


def llama_config(shape: ModelShape, *, bos_id: int = 1, eos_id: int = 2, pad_id: int | None = 3) -> Any:
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_seq_len,
        rms_norm_eps=shape.norm_eps,
        rope_parameters={"rope_type": "default", **(shape.rope or {}), "rope_theta": shape.rope_theta},
        tie_word_embeddings=shape.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        head_dim=shape.head_dim,
        attention_dropout=0.0,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=False,
        initializer_range=0.02,
        attn_implementation="sdpa",
    )
    return LlamaConfig(**kwargs)


def model_config(shape: ModelShape, *, bos_id: int = 1, eos_id: int = 2, pad_id: int | None = 3) -> Any:
    """The transformers config of `shape`: LlamaConfig for our presets, or the Hugging Face model's own config
    (its special ids are its own; `pipeline.data.tokenizer.check_tokenizer` makes sure the data's tokenizer agrees)."""
    if shape.hf_config is None:
        return llama_config(shape, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    from transformers import AutoConfig

    fields = {k: v for k, v in shape.hf_config.items() if k not in ("model_type", "torch_dtype", "dtype")}
    config = AutoConfig.for_model(shape.hf_config["model_type"], **fields)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return config


def causal_lm_class(config: Any) -> Any:
    """transformers' *ForCausalLM class for a config (the table AutoModelForCausalLM itself uses)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def build_model(
    shape: ModelShape, *, bos_id: int = 1, eos_id: int = 2, pad_id: int | None = 3, skip_init: bool = False
) -> Any:
    """The one constructor of our models: transformers' causal LM for the shape's family (LlamaForCausalLM for our
    presets), fp32, that can also return its per-token training loss computed in chunks
    (`forward(input_ids, loss_labels=...)`, see `pretraining_class`). `skip_init` skips transformers' random init
    (the caller fills every weight: our deterministic init, a checkpoint, or safetensors); otherwise seed torch
    first for a reproducible init. Under ZeRO-3 call it inside `deepspeed.zero.Init` (pipeline.train.engine), after
    `pretraining_class(shape)`."""
    config = model_config(shape, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    cls = pretraining_class(shape)
    if not skip_init:
        return cls(config)
    with transformers_helper("transformers.initialization", "no_init_weights")():
        model = cls(config)
    if config.tie_word_embeddings:
        model.tie_weights()  # transformers ties inside its weight init, which no_init_weights skips
    return model


def loss_chunk_tokens(vocab_size: int, budget_bytes: int = 2**28) -> int:
    """Tokens per loss chunk: the fp32 logits of one chunk stay within `budget_bytes` (256 MiB: 2,097 tokens at a
    32k vocabulary, 524 at 128k)."""
    return max(1, budget_bytes // (4 * vocab_size))


def token_losses(logits: Any, labels: Any) -> Any:
    """Per-token cross-entropy in fp32, 0 where the label is -100 (padding); logits (N, V), labels (N,)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none")


_PRETRAINING_CLASSES: dict[Any, Any] = {}


def pretraining_class(shape: ModelShape | None = None) -> Any:
    """The shape's causal LM class (LlamaForCausalLM for our presets) plus a chunked training loss. Call it once
    before entering `deepspeed.zero.Init`: importing
    transformers' model code under it fails (zero.Init patches torch.Tensor.__new__, which torch._dynamo's first
    import checks). The full fp32 logits of a micro-batch (B*T*V*4 bytes: 2 GiB
    at micro-batch 8, seq 2048, vocab 32k, kept for the backward) are never built: the loss runs over chunks of
    `loss_chunk_tokens` tokens, each recomputed in the backward (activation checkpointing of lm_head + loss), so
    one chunk's logits are alive at a time; or, with `fused_loss` set, by a fused kernel that returns the summed
    loss. lm_head is called as a module, so ZeRO-3 gathers it as usual. Without
    `loss_labels` the model is the transformers class unchanged (generation, evaluation, export)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    if shape is None or shape.hf_config is None:
        from transformers import LlamaForCausalLM

        base = LlamaForCausalLM
    else:
        base = causal_lm_class(model_config(shape))
    if base in _PRETRAINING_CLASSES:
        return _PRETRAINING_CLASSES[base]

    class ForPretraining(base):  # type: ignore[misc, valid-type]
        loss_chunk_tokens: int | None = None  # None: by the vocabulary (loss_chunk_tokens())
        fused_loss: Any = None
        """A fused lm_head + loss (pipeline.model.kernels): (hidden, weight, labels) -> the summed loss, used for
        training (with gradients); evaluation keeps the per-token chunked loss."""

        def forward(self, *args: Any, loss_labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
            if loss_labels is None:
                return super().forward(*args, **kwargs)
            hidden = self.model(*args, **kwargs).last_hidden_state  # (B, T, h)
            flat = hidden.reshape(-1, hidden.size(-1))  # (B*T, h)
            labels = loss_labels.reshape(-1)
            if self.fused_loss is not None and torch.is_grad_enabled():
                return self.fused_loss(flat, self.lm_head.weight, labels)  # () fp32: the sum over real tokens
            chunk = self.loss_chunk_tokens or loss_chunk_tokens(self.config.vocab_size)

            def piece(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return token_losses(self.lm_head(h), y)

            if flat.size(0) <= chunk or not torch.is_grad_enabled():
                return torch.cat(
                    [piece(flat[i : i + chunk], labels[i : i + chunk]) for i in range(0, flat.size(0), chunk)]
                )
            return torch.cat(
                [
                    checkpoint(piece, flat[i : i + chunk], labels[i : i + chunk], use_reentrant=False)
                    for i in range(0, flat.size(0), chunk)
                ]
            )  # (B*T,) fp32

    ForPretraining.__name__ = ForPretraining.__qualname__ = f"{base.__name__}Pretraining"
    _PRETRAINING_CLASSES[base] = ForPretraining
    return ForPretraining


TRANSFORMERS_NEEDED = "transformers>=5,<6"


def transformers_helper(module: str, name: str) -> Any:
    """A transformers internal that model building relies on, or one clear error naming the version needed."""

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        import transformers

        raise ConfigError(
            [
                f"transformers {transformers.__version__} lacks {module}.{name}, which model building "
                f"needs; install {TRANSFORMERS_NEEDED} (pip install '{TRANSFORMERS_NEEDED}')"
            ]
        ) from None
