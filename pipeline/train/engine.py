"""The one place a DeepSpeed engine is made: the model (under `zero.Init` for ZeRO-3), its initial weights, the
optimizer, the engine."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.data.manifest import TokenizerInfo, model_token_ids
from pipeline.errors import PipelineError
from pipeline.model import ModelShape, build_model, kernels, pretraining_class, transformers_helper, varlen
from pipeline.model.kernels import Fp8Choice
from pipeline.model.varlen import NO_MASKS, DocumentAttention
from pipeline.plan.cluster import Layout
from pipeline.train.runtime import sequence
from pipeline.train.runtime.dist import accelerator_name, on_rank0
from pipeline.train.runtime.weights import init_weights, load_initial_weights
from pipeline.train.setup.config import PretrainConfig
from pipeline.train.setup.optimizers import OPTIMIZERS


def training_dtype(ds: dict[str, Any]) -> torch.dtype:
    """The dtype DeepSpeed casts the parameters to (bf16, fp16, else fp32): what the model is built in."""
    if (ds.get("bf16") or {}).get("enabled") is True:
        return torch.bfloat16
    if (ds.get("fp16") or {}).get("enabled") is True:
        return torch.float16
    return torch.float32


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Any:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_for(shape: ModelShape, ds: dict[str, Any], tok: TokenizerInfo, stage: int) -> Any:
    """The model, weights not yet filled: under ZeRO-3 built inside `deepspeed.zero.Init`, so that each parameter
    is partitioned as it is created and no rank ever holds the whole model (training and distributed evaluation
    both build it here). Without ZeRO-3 every rank holds the whole model in host memory until DeepSpeed takes it,
    so it is built in the dtype DeepSpeed casts it to (bf16: half of fp32's bytes, 4 ranks of a 7B on one node
    hold 54 GB instead of 108); the values are those of the fp32 build cast (pipeline.plan.memory.build_bytes).
    `stage`: the run's ZeRO stage (its Layout's), `ds` the JSON zero.Init and the dtype are read from."""
    pretraining_class(shape)  # imports transformers' model code now, not under zero.Init (see its docstring)
    transformers_helper("transformers.initialization", "no_init_weights")
    with contextlib.ExitStack() as stack:
        if stage != 3:  # RoPE's inv_freq stays fp32: transformers computes it as float
            stack.enter_context(default_dtype(training_dtype(ds)))
        if stage == 3:
            import deepspeed

            # As transformers' own zero.Init path does: keep RoPE's arange in fp32, then partition.
            stack.enter_context(
                transformers_helper("transformers.integrations.deepspeed", "prevent_arange_dtype_change")()
            )
            stack.enter_context(deepspeed.zero.Init(config_dict_or_path=ds))
        return build_model(shape, skip_init=True, **model_token_ids(tok))  # the caller fills every weight


def activation_offload(layout: Layout, device: torch.device) -> Any | None:
    """DeepSpeed's offload of checkpointed layer inputs to pinned host memory (0.19.8's
    CheckpointHiddenStatesOffload, for transformers' checkpointed layers), when the DeepSpeed JSON asks for it with
    `activation_checkpointing.cpu_checkpointing`: one reusable context each micro-step's forward and backward run
    in (its `stats` count what moved). None when off. On the CPU accelerator it moves nothing (no streams, and
    the tensors are already in host memory)."""
    if not layout.offload_activations:
        return None
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )

    return get_checkpoint_hidden_states_offloading_ctx_manager(use_pin_memory=device.type == "cuda")


@dataclass(frozen=True, slots=True)
class Speed:
    """The speed switches resolved for this rank's device and DeepSpeed config (pipeline.model.kernels)."""

    compile: bool
    attention: kernels.AttentionChoice
    kernels: kernels.KernelChoice
    compile_note: str
    fp8: Fp8Choice = Fp8Choice(False, False, "fp8: off")
    documents: DocumentAttention = NO_MASKS
    """How attention keeps documents apart and windows honoured (decided before launch: Prepared.documents)."""

    def notes(self) -> list[str]:
        masks = [self.documents.note] if self.documents.kind != "sdpa" else []
        return [self.compile_note, self.attention.note, self.kernels.note, self.fp8.note, *masks]

    def record(self) -> dict[str, Any]:
        """What environment.json and the bench keep."""
        return {
            "compile": self.compile,
            "attention": self.attention.backend,
            "attention_timings_ms": self.attention.timings_ms,
            "kernels": self.kernels.kernels,
            "fused_loss": self.kernels.fused_loss,
            "fp8": self.fp8.on,
            "fp8_emulated": self.fp8.emulate,
            "attention_masks": self.documents.kind,
        }


def choose_speed(
    cfg: PretrainConfig,
    layout: Layout,
    shape: ModelShape,
    micro_batch_size: int,
    seq_len: int,
    device: torch.device,
    documents: DocumentAttention | None = None,
) -> Speed:
    """train.compile, train.attention and train.kernels resolved here, and applied to the process (the SDPA
    priority, transformers' patched modules): call once on every rank, before the model is built. `documents`:
    the attention path chosen before launch (the model is built with it)."""
    stage = layout.stage
    long_context = layout.sequence_parallel > 1 or layout.tiled_mlp > 1
    compile_on, compile_note = kernels.choose_compile(cfg.train.compile, device.type, stage, long_context, os.environ)
    # Rank 0 times the backends, at the shape each rank's attention runs at, and every rank takes its choice:
    # timings within noise of each other would otherwise give ranks different kernels.
    attention = on_rank0(
        lambda: kernels.choose_attention(
            cfg.train.attention, shape, micro_batch_size, seq_len, device, layout.sequence_parallel
        )
    )
    kernel_set = kernels.choose_kernels(cfg.train.kernels, shape, device.type, zero3=stage == 3, compiled=compile_on)
    kernels.apply_attention(attention)
    kernels.apply_kernels(kernel_set, shape)
    fp8 = kernels.choose_fp8(cfg.train.fp8, device, shape)
    return Speed(compile_on, attention, kernel_set, compile_note, fp8, documents or NO_MASKS)


def build_training_model(
    shape: ModelShape,
    ds: dict[str, Any],
    layout: Layout,
    cfg: PretrainConfig,
    tok: TokenizerInfo,
    rank: int,
    speed: Speed | None = None,
) -> torch.nn.Module:
    """The model with its initial weights (our deterministic init, or `model.init_from`), checkpointing set, and
    the speed switches `speed` chose (None: the plain eager model); `layout` says the ZeRO stage, the tiles and
    checkpointing, `ds` the dtype."""
    stage3 = layout.stage == 3
    torch.manual_seed(cfg.train.seed)
    model = build_for(shape, ds, tok, layout.stage)
    model.loss_chunk_tokens = cfg.train.loss_chunk_tokens
    if speed is not None and speed.kernels.fused_loss:
        model.fused_loss = kernels.fused_linear_cross_entropy()
    if cfg.model.init_from:
        load_initial_weights(model, cfg.model.init_from, rank, stage3)
    else:
        gpu = torch.device("cuda", torch.cuda.current_device()) if accelerator_name() == "cuda" else None
        init_weights(model, cfg.train.seed, rank, stage3, gpu)
    if speed is not None:
        varlen.use(model, speed.documents)  # before Ulysses wraps the model's attention (build_engine)
    kernels.tile_mlp(model, layout.tiled_mlp)  # before compiling: the compiled layer calls the tiled MLP
    if speed is not None:
        kernels.apply_fp8(model, speed.fp8)
    if speed is not None and speed.compile:
        for layer in model.model.layers:
            layer.compile()  # in place: parameter names and checkpoints stay those of the eager model
    if layout.activation_checkpointing:
        # Non-reentrant: the reentrant variant breaks with ZeRO-3 (DeepSpeed PR #7780).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def build_engine(
    cfg: PretrainConfig,
    ds: dict[str, Any],
    layout: Layout,
    shape: ModelShape,
    tok: TokenizerInfo,
    rank: int,
    speed: Speed | None = None,
) -> Any:
    import deepspeed

    model = build_training_model(shape, ds, layout, cfg, tok, rank, speed)
    mpu = None
    if (sp := layout.sequence_parallel) > 1:
        mpu = sequence.register(model, sp, ds["train_micro_batch_size_per_gpu"])
    groups = param_groups(model, cfg.optim.weight_decay)
    build = OPTIMIZERS[cfg.optim.name].build
    client_optimizer = build(groups, cfg.optim) if build else None
    check_aio(ds, layout)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=client_optimizer,
        model_parameters=None if client_optimizer else groups,  # type: ignore[arg-type]
        config=ds,
        mpu=mpu,
    )
    entry = OPTIMIZERS[cfg.optim.name]
    for group in engine.optimizer.param_groups:  # what the schedule's rate is multiplied by (pipeline.train.step)
        group["lr_scale"] = entry.lr_scale(group, cfg.optim)
    return engine


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only; norms and biases (1-D) get none."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # Under ZeRO-3 a partitioned parameter's own shape is empty; ds_shape keeps the real one.
        ndim = len(getattr(p, "ds_shape", p.shape))
        (decay if ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def check_aio(ds: dict[str, Any], layout: Layout) -> None:
    """NVMe offload (the layout's) needs DeepSpeed's async_io op and a writable swap folder (the JSON's) here."""
    zero = ds.get("zero_optimization", {})
    if "nvme" in (layout.offload_optimizer, layout.offload_param):
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible():
            raise PipelineError(
                "NVMe offload needs DeepSpeed's async_io op, which cannot build here (install "
                "libaio-dev, then check `ds_report`); or use ds_configs/zero3_offload.json (CPU)"
            )
        for k in ("offload_optimizer", "offload_param"):
            path = zero.get(k, {}).get("nvme_path")
            if path and not os.access(path, os.W_OK):
                raise PipelineError(f"zero_optimization.{k}.nvme_path {path}: not a writable folder on this node")
