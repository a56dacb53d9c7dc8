"""Memory of one training configuration: per GPU (live tensors at the peak, what the card must hold, the margin
kept) and per node in host RAM, at start-up (the model's build) and in the steady state; and of evaluating a
checkpoint. Pure arithmetic over the model shape; the coefficients are measured (see each).

One job: every term the planner's fit verdict and evaluate's batch read, beside the constants they share
(fragmentation, margin).

GPU, like with like: `peak_allocated` is what `torch.cuda.max_memory_allocated` reports (live tensors at the
peak); `reserved` adds the allocator's slack and the CUDA context, and is what the card must hold. A plan fits
when `reserved` plus a margin (max(1.5 GiB, 7% of the card)) is within the card."""

from __future__ import annotations

import math

from pipeline.model import ModelShape
from pipeline.plan.cluster import ZENFLOW_TOPK, Cluster, Layout, Stack

GiB = 2**30
CUDA_CONTEXT = int(0.8 * GiB)  # CUDA context, cuBLAS/NCCL workspaces: outside max_memory_allocated
FRAGMENTATION = 1.10  # caching-allocator slack on transient tensors (activations, logits): many sizes, reused
REDUCE_BYTES = 8
"""ZeRO-3's gradient reduction, per element of `reduce_bucket_size`: the bf16 bucket, the copy it is reduced in,
the rearranged output and the partition copies (8 bytes at once). Accumulating in fp32 adds the fp32 copy of this
rank's partition of the bucket (4 / world bytes: DeepSpeed's default reduce-scatter path casts partitions)."""
BUFFER_FRAGMENTATION = 5.0
"""Those reduce temporaries are allocated and freed at every micro-step in sizes the caching allocator cannot
reuse for one another: under a memory cap (a 24 GiB card) about 5x their live size stays reserved. Fitted to the
one OOM we measured: DeepSpeed's defaults (reduce 5e8) ran a 2-layer 70B slice out of a 24 GiB cap on an H200
whose live tensors were 9.4 GiB (the smallest factor that puts its reserved memory above the cap is 4.8), while
1e8 peaked at 5.8 GiB and ran; LLaMA-Factory's h^2 buckets (S1-S4) fit 24 GB cards."""
ZERO3_CHUNKED_LOSS_UNEXPLAINED = 5.6
"""Bytes per lm_head parameter that ZeRO-3 runs of this trainer (chunked loss) held at their peak beyond every
term above, carried as measured until a memory snapshot names them: the 2- and 4-layer 70B slices on the H200
under a 23 GiB cap (bench/results/gpu-h200-2026-12-04.json) peaked at 7.57 and 7.82 GiB where the terms give 6.20
and 6.45, the same 1.37 GiB at both depths (so not per layer), 5.6 bytes for each of the 262M lm_head parameters;
the 7B slices' terms were above their peaks by less than the 0.68 GiB this adds there (now 1.09-1.18x). A guess
at the mechanism, not yet checked: the lm_head gradient of every chunk alive beside the accumulated one, and its
fp32 copy for the reduce. The plan names it ("measured_unexplained") rather than hide it in another term."""
MARGIN_MIN_BYTES = int(1.5 * GiB)
MARGIN_FRACTION = 0.07
RANK_HOST_OVERHEAD = 6 * GiB  # torch + CUDA libraries + DeepSpeed per rank process, host RAM

# Bytes saved for the backward per token by one decoder layer in bf16, per hidden unit (h) and per FFN unit (f), by
# the modules that run it (Stack.kernels), each counted with saved-tensor hooks on the graph it prices
# (tests/unit/plan/test_memory.py re-counts every one):
# - hf, transformers' LlamaDecoderLayer with SDPA: 20 h (bf16 inputs/outputs of q, k, v, o, the residuals, and the
#   fp32 RMSNorm intermediates) + 8 f (SwiGLU gate, up, act, product);
# - compiled, the same layer under torch.compile (Inductor keeps the norms' inputs and 1/rms, recomputes the rest):
#   10 h + 6 f (gate, up and down_proj's input);
# - liger, Liger Kernel's RMSNorm and SwiGLU (each norm keeps its input and 1/rms; LigerSiLUMulFunction keeps gate
#   and up, and down_proj, a Linear, its input: the product): 12 h + 6 f;
# - fused, the published stacks' FlashAttention with fused norm and SwiGLU kernels that recompute the product
#   (TinyLlama's, llm-foundry's): 10 h + 4 f.
# Every layout adds 4 h_kv (k, v) and 5 a (attention's fp32 log-sum-exp and its output per head); those whose norms
# keep 1/rms apart (all but hf, whose 20 h holds the fp32 intermediates) 8 bytes a token (two norms, fp32).
SAVED_PER_H_F: dict[str, tuple[int, int]] = {"hf": (20, 8), "compiled": (10, 6), "liger": (12, 6), "fused": (10, 4)}
ACT_PER_H, ACT_PER_F = SAVED_PER_H_F["hf"]
ACT_PER_HKV, ACT_PER_HEAD, NORM_RSTD_BYTES = 4, 5, 8
BACKWARD_PER_F, BACKWARD_PER_H = 4, -2
"""A layer's backward holds, beyond what the layer saved, the gradients of its MLP's intermediates (4 f at once)
while the h-sized tensors it saved are freed one by one. Counted on the CPU as the live peak of one layer's forward
and backward with every storage tracked until freed (tests/unit/plan/test_memory_graphs.py), at every length:
saved + 4 f - 6 h on transformers' layer, saved + 4 f - 2 h on Liger's contract; the term is the larger."""
ATTENTION_BACKWARD_PER_H = 4
"""The flash attention backward's fp32 dq accumulator (q's size in fp32: 4 bytes a hidden unit a token), alive
through the attention's backward on a GPU (FlashAttention-2's and SDPA's flash and cuDNN kernels; the CPU's SDPA has
none, so the CPU measurement is below the term by it)."""
ULYSSES_COPY_PER_H = 8
"""Under sequence parallelism Ulysses' all-to-all copies: q, k, v and the attention output each rearranged into a
contiguous send buffer and received into another (DeepSpeed 0.19.8 ulysses_sp.py:168-231), 2 x 2 bytes a hidden
unit a local token for the output and the same for q (k, v: h_kv) while they are in flight, at the attention's
forward and again in its backward: moments when the layer's MLP holds nothing (`layer_backward_bytes_per_token`)."""
# Eager attention (scores materialised) keeps the bf16 scores and probabilities: 4 bytes per score.
EAGER_SCORE_KEPT_BYTES = 4
# The plain loss over full logits: bf16 logits, their fp32 copy, fp32 log-softmax and the fp32 gradient.
LOGIT_BYTES = 14
ACT_OFFLOAD_KEPT = 4
"""Checkpointed layer inputs that stay on the GPU under activation offload (DeepSpeed 0.19.8's
CheckpointHiddenStatesOffload): the last one (its backward needs it first), two whose copies out are in flight
(max_fwd_stash_count), and the one restored for the layer being recomputed."""
ZENFLOW_STATE_BYTES = 4
"""ZenFlow's selective Adam on the GPU: m and v of the top-k columns of every matrix, in the parameters' dtype
(bf16), for the whole matrix on every rank (measured on a real engine: 4 x topk x parameters per rank, ZeRO-2,
2 ranks; tests/multiproc/test_offload_features.py); its selected gradients add 2 x topk x parameters while the
step runs."""


def layer_activation_bytes_per_token(shape: ModelShape, stack: Stack | None = None, seq_len: int = 0) -> int:
    """What one decoder layer saves for its backward per token, as the stack's modules save it (SAVED_PER_H_F)."""
    stack = stack or Stack()
    h_kv = shape.num_kv_heads * shape.head_dim
    per_h, per_f = SAVED_PER_H_F[stack.kernels]
    scores = EAGER_SCORE_KEPT_BYTES * shape.num_heads * seq_len if stack.attention == "eager" else 0
    return (
        (0 if stack.kernels == "hf" else NORM_RSTD_BYTES)
        + per_h * shape.hidden_size
        + ACT_PER_HKV * h_kv
        + per_f * shape.ffn_hidden_size
        + ACT_PER_HEAD * shape.num_heads
        + scores
    )


def layer_backward_bytes_per_token(shape: ModelShape, sequence_parallel: int = 1) -> int:
    """What one layer's backward holds per token beyond what the layer saved, at its peak: the MLP's backward
    (BACKWARD_PER_F and _PER_H, with ATTENTION_BACKWARD_PER_H as the GPU runs measured it), or, under sequence
    parallelism, the attention's moments if larger: Ulysses' copies (ULYSSES_COPY_PER_H on q and the output, 4 bytes
    a kv unit on k and v) are alive in the attention's forward (recomputed, before the MLP saved anything) and in
    its backward (after the MLP's backward freed what it saved), so they stand beside the layer's saved tensors less
    its MLP's. Counted on 2 gloo ranks (tests/distributed/test_ulysses_memory.py): a layer's live peak under
    Ulysses equals its peak on one rank at the same local length, the MLP's backward."""
    mlp_moment = (
        BACKWARD_PER_F * shape.ffn_hidden_size + (BACKWARD_PER_H + ATTENTION_BACKWARD_PER_H) * shape.hidden_size
    )
    if sequence_parallel <= 1:
        return mlp_moment
    ulysses = ULYSSES_COPY_PER_H * shape.hidden_size + 4 * shape.num_kv_heads * shape.head_dim
    mlp_saved = min(per_f for _, per_f in SAVED_PER_H_F.values()) * shape.ffn_hidden_size  # freed by then
    return max(mlp_moment, ATTENTION_BACKWARD_PER_H * shape.hidden_size + ulysses - mlp_saved)


def activation_bytes(
    shape: ModelShape,
    seq_len: int,
    micro: int,
    checkpointing: bool,
    loss_chunk_tokens: int | None = None,
    stack: Stack | None = None,
    offloaded: bool = False,
    mlp_tiles: int = 0,
    sequence_parallel: int = 1,
) -> dict[str, float]:
    """Activation memory of one micro-batch (bf16) of `seq_len` tokens a sample on this rank: `layers` at the start
    of the backward (full recompute keeps each layer's bf16 input plus one layer's activations and its backward's
    working set while it is recomputed; `offloaded`: only ACT_OFFLOAD_KEPT of those inputs stay on the GPU),
    `one_layer` (that layer), `at_loss` (what is kept while the loss's backward runs, before any layer's),
    `logits` (the loss's peak: full logits, or one chunk of `loss_chunk_tokens` as our trainer computes it) and
    `embeddings`. `mlp_tiles` (the tiled MLP): no layer keeps its SwiGLU intermediates for
    the backward, which recomputes them, and their gradients, one tile at a time."""
    sb = seq_len * micro
    per_token = layer_activation_bytes_per_token(shape, stack, seq_len)
    mlp = SAVED_PER_H_F[(stack or Stack()).kernels][1] * shape.ffn_hidden_size
    backward = layer_backward_bytes_per_token(shape, sequence_parallel)
    mlp_backward = BACKWARD_PER_F * shape.ffn_hidden_size  # the part of `backward` a tile holds a tile of
    if mlp_tiles > 1:
        kept_one = float(sb * (per_token - mlp))  # a layer's activations but its MLP's intermediates
        one = kept_one + sb / mlp_tiles * (mlp + mlp_backward) + sb * (backward - mlp_backward)
    else:
        kept_one = float(sb * per_token)
        one = kept_one + sb * backward
    kept = min(shape.num_layers, ACT_OFFLOAD_KEPT) if offloaded else shape.num_layers
    # while the loss's backward runs: the checkpointed inputs, or every layer's saved activations
    at_loss = kept * 2 * sb * shape.hidden_size if checkpointing else shape.num_layers * kept_one
    # then while the last layer's backward runs: it recomputed, or its saved ones, with its working set
    layers = at_loss + (one if checkpointing else one - kept_one)
    logit_tokens = sb if loss_chunk_tokens is None else min(sb, loss_chunk_tokens)
    return {
        "at_loss": float(at_loss),
        "layers": float(layers),
        "one_layer": one,
        "logits": float(LOGIT_BYTES * logit_tokens * shape.vocab_size),
        "embeddings": float(4 * sb * shape.hidden_size),
    }


def deepspeed_model_states(
    stage: int,
    psi: int,
    largest_layer: int,
    gpus_per_node: int,
    nodes: int,
    offload_optimizer: bool,
    offload_param: bool,
    buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(cpu bytes per node, gpu bytes per GPU) for model states, exactly as DeepSpeed's estimators compute them
    (stage 2/3; stages 0/1 by the same accounting), zero.Init assumed."""
    g = nodes * gpus_per_node
    if stage == 3:
        ll = 4 * largest_layer
        if offload_optimizer and offload_param:
            return int(psi * 18 * (1 / nodes) * buffer_factor), int(ll)
        if offload_optimizer:
            return int(psi * 16 * (1 / nodes) * buffer_factor), int(ll + int(2 * psi / g))
        return int(largest_layer * 4 * gpus_per_node * buffer_factor), int(ll + int(18 * psi / g))
    if stage == 2 or (stage == 1 and offload_optimizer):
        if offload_optimizer:
            return int(psi * max(4 * g, 16) * buffer_factor), int(2 * psi)
        return int(psi * 4 * gpus_per_node * buffer_factor), int(2 * psi + int(18 * psi / g))
    if stage == 1:  # 16-bit params and grads whole; fp32 grads, master and Adam moments partitioned
        return int(psi * 4 * gpus_per_node * buffer_factor), int(4 * psi + int(16 * psi / g))
    return int(psi * 4 * gpus_per_node * buffer_factor), int(20 * psi)  # ZeRO-0: everything on every GPU


def state_split(
    stage: int, psi: int, g: int, off_opt: bool, off_param: bool, fp32_accum: bool = False, moment_bytes: float = 8.0
) -> dict[str, float]:
    """GPU model-state bytes per GPU as a real engine holds them (checked against one in
    tests/multiproc/test_plan_measured.py): parameters, gradients (16-bit and fp32 partitions), optimizer states.
    `fp32_accum` (data_types.grad_accum_dtype fp32): ZeRO-2/3 accumulate into an fp32 partition (+2 B a
    partitioned parameter), ZeRO-1 becomes DeepSpeed's BF16_Optimizer with a whole fp32 gradient (4 B a parameter)."""
    accum = 4 if fp32_accum else 2  # bytes of the gradient partition micro-steps accumulate into
    states = 4 + moment_bytes  # fp32 master weights and the optimizer's moments
    if stage == 3:
        return {
            "params": 0 if off_param else 2 * psi / g,
            "grads": 0 if off_opt else (accum + 4) * psi / g,
            "optimizer": 0 if off_opt else states * psi / g,
        }
    if stage == 2:
        return {
            "params": 2 * psi,
            "grads": 0 if off_opt else (accum + 4) * psi / g,
            "optimizer": 0 if off_opt else states * psi / g,
        }
    if stage == 1:
        fp32_grads = 4 * psi if fp32_accum and not off_opt else (0 if off_opt else 4 * psi / g)
        return {"params": 2 * psi, "grads": 2 * psi + fp32_grads, "optimizer": 0 if off_opt else states * psi / g}
    return {"params": 2 * psi, "grads": 6 * psi, "optimizer": states * psi}


def margin_bytes(card_gib: float) -> float:
    return max(MARGIN_MIN_BYTES, MARGIN_FRACTION * card_gib * GiB)


def _model_states(cand: Layout, psi: int, g: int) -> tuple[dict[str, float], float]:
    """Per-GPU model states (state_split, with bf16 master weights under ZeRO-3 and ZenFlow's GPU-side moments) and
    the gradients among them that exist only from the backward to the step (ZenFlow's selected columns)."""
    off_opt, off_par = cand.offload_optimizer != "none", cand.offload_param != "none"
    split = state_split(cand.stage, psi, g, off_opt, off_par, cand.fp32_grad_accum, cand.moment_bytes)
    if cand.bf16_master and cand.stage == 3 and not off_opt:  # bf16 master and gradient partitions on the GPU
        split["grads"] -= 2 * psi / g
        split["optimizer"] -= (2 + (4 if cand.bf16_optimizer_states else 0)) * psi / g
    zenflow_grads = 0.0
    if cand.zenflow_interval:
        split["optimizer"] += ZENFLOW_STATE_BYTES * ZENFLOW_TOPK * psi
        zenflow_grads = 2 * ZENFLOW_TOPK * psi
    return split, zenflow_grads


def _activations(
    shape: ModelShape, seq_len: int, cand: Layout, loss_chunk_tokens: int | None, stack: Stack
) -> dict[str, float]:
    """activation_bytes of a rank's share of the tokens, with the loss the stack computes. Under sequence
    parallelism a rank holds seq_len / N tokens of each sample in every layer (attention too: after Ulysses'
    all-to-all, all tokens of N-th of the heads); the loss, its share of the tokens."""
    local = seq_len // cand.sequence_parallel
    if stack.loss_fused:  # a fused linear cross-entropy (Liger's) computes ~tokens x h / V tokens at a time
        tokens = cand.micro_batch_size * local
        loss_chunk_tokens = max(256, tokens * shape.hidden_size // shape.vocab_size)
    act = activation_bytes(
        shape,
        local,
        cand.micro_batch_size,
        cand.activation_checkpointing,
        loss_chunk_tokens,
        stack,
        cand.offload_activations,
        cand.tiled_mlp,
        cand.sequence_parallel,
    )
    if stack.loss_fused and stack.switches is not None:  # this trainer's fused loss (Liger's, fp32 accumulation)
        # computes its gradients in the forward and keeps them for the backward: lm_head's weight gradient in fp32
        # and the hidden states' gradient in bf16
        act["logits"] += 4.0 * shape.embedding_params() + 2.0 * cand.micro_batch_size * local * shape.hidden_size
    act["document_mask"], act["document_mask_one_layer"] = document_mask_bytes(
        shape, seq_len, cand.micro_batch_size, cand.activation_checkpointing, stack
    )
    return act


def document_mask_bytes(
    shape: ModelShape, seq_len: int, micro: int, checkpointing: bool, stack: Stack
) -> tuple[float, float]:
    """(at the start of the backward, at its end) bytes of whole-document samples on SDPA's dense mask
    (Stack.dense_mask): the (B, 1, T, T) boolean mask, alive from the model's forward to its last layer's
    backward, and the bf16 additive bias SDPA's kernels that take a mask make of it in every call and keep for the
    backward: in each layer that keeps its attention (all of them without checkpointing; the one recomputed with
    it). The varlen path and plain packing: none."""
    if not stack.dense_mask:
        return 0.0, 0.0
    mask = float(micro * seq_len * seq_len)
    bias = 2.0 * mask
    return mask + bias * (1 if checkpointing else shape.num_layers), mask + bias


def _engine_buffers(
    shape: ModelShape, c: Cluster, cand: Layout, stack: Stack, chunked_loss: bool, zenflow_grads: float
) -> tuple[float, float, float, float]:
    """(the engine's buffers, their reduce temporaries, the measured unexplained term, the gradients alive from
    the backward to the step). ZeRO-3: the gathered 16-bit parameters (the module in use and the prefetched ones,
    DeepSpeed releasing a module after its use, at most max live), the reduce path's temporaries, the largest
    layer's gradient. ZeRO-0-2: their buckets, and the bf16 gradients (whole under ZeRO-0/1)."""
    psi, g, largest = shape.num_params(), c.world, shape.largest_layer_params()
    if cand.stage != 3:
        buffers = 4.5 * 2 * cand.reduce_bucket if cand.stage in (1, 2) else 2 * 2.5e7
        return buffers, 0.0, 0.0, (2.0 * psi if cand.stage in (0, 1) else 0.0) + zenflow_grads
    live = 2 * min(cand.max_live, shape.layer_params() + cand.prefetch_bucket, psi)
    mlp = shape.mlp_params()
    if cand.tiled_mlp > 1 and (cand.max_reuse or cand.max_live) >= mlp:  # gate, up, down kept across the tiles
        live = max(live, 2 * mlp)
    reduce = cand.reduce_bucket * (REDUCE_BYTES + (4 / g if cand.fp32_grad_accum else 0))
    unexplained = 0.0
    if chunked_loss and not stack.loss_fused:  # this trainer's chunked loss under ZeRO-3
        unexplained = ZERO3_CHUNKED_LOSS_UNEXPLAINED * shape.embedding_params()
    if stack.engine == "fsdp":  # one flat 16-bit gradient per layer, reduce-scattered into its shard
        reduce = 2.0 * cand.reduce_bucket
    return live + reduce + unexplained + 2.0 * largest, reduce, unexplained, 0.0


def gpu_memory(
    shape: ModelShape,
    seq_len: int,
    c: Cluster,
    cand: Layout,
    loss_chunk_tokens: int | None,
    stack: Stack | None = None,
) -> dict[str, float]:
    """Per-GPU bytes. The peak is the largest of three moments: the loss's backward (what the layers keep, the
    logits and their gradient), the last layer's backward after it (what the layers keep, that layer recomputed and
    its backward's working set; the logits of a chunked or fused loss are gone, a whole-logits loss's are priced
    alive, as measured) and the backward's end (buckets full, ZeRO-0/1's whole bf16
    gradients alive).
    Model states and ZeRO-3's gathered layer and buffers are alive at both. What the card must hold (`reserved`)
    adds the allocator's slack on the transients only: activations and logits at FRAGMENTATION, ZeRO-3's
    bucket-sized buffers at BUFFER_FRAGMENTATION; model states are allocated once."""
    stack = stack or Stack()
    split, zenflow_grads = _model_states(cand, shape.num_params(), c.world)
    act = _activations(shape, seq_len, cand, loss_chunk_tokens, stack)
    chunked = loss_chunk_tokens is not None
    buffers, reduce, unexplained, transient_grads = _engine_buffers(shape, c, cand, stack, chunked, zenflow_grads)
    static = sum(split.values()) - transient_grads
    # the loss's backward, then the last layer's
    if chunked or stack.loss_fused:  # the loss's logits are made and freed chunk by chunk, before any layer's
        forward_act = max(act["at_loss"] + act["logits"], act["layers"])
    else:  # the whole logits' loss: as measured (the H200 anchors' 70B slices), its bytes outlive it
        forward_act = act["layers"] + act["logits"]
    forward_act += act["embeddings"] + act["document_mask"]
    zero3_buffers = buffers if cand.stage == 3 else 0.0  # ZeRO-3's live through the forward as well
    forward = forward_act + zero3_buffers
    # the end of the backward: gradients, few activations
    backward = buffers + transient_grads + act["one_layer"] + act["document_mask_one_layer"]
    peak = static + max(forward, backward)
    # The reserved memory is the larger of the two moments, each with its slack: the reduce temporaries at
    # BUFFER_FRAGMENTATION (they are alive in both), everything else at FRAGMENTATION.
    reduce_part = reduce if cand.stage == 3 and stack.engine == "deepspeed" else 0.0
    reserved_transients = (max(forward, backward) - reduce_part) * FRAGMENTATION + reduce_part * BUFFER_FRAGMENTATION
    reserved = static + reserved_transients + CUDA_CONTEXT
    working = 2.0 * shape.largest_layer_params() if cand.stage == 3 else 0.0
    return {
        **split,
        "working_layer": working,
        "ds_buffers": buffers - working - unexplained,
        "measured_unexplained": unexplained,
        "activations": act["layers"] + act["embeddings"],
        "document_mask": act["document_mask"],
        "logits": act["logits"],
        "peak_phase_backward": float(backward > forward),
        "peak_allocated": peak,
        "reserved": reserved,
        "margin": margin_bytes(c.gpu.memory_gib),
        "cuda_context": float(CUDA_CONTEXT),
        "fragmentation": reserved - CUDA_CONTEXT - peak,
        "total": reserved,
    }


def pinned(nbytes: float, pieces: int = 1) -> float:
    """Pinned host memory as torch allocates it: each of `pieces` equal allocations rounded up to a power of two
    (the caching host allocator's rounding, kept for the life of the process)."""
    if nbytes <= 0:
        return 0.0
    piece = nbytes / pieces
    return pieces * float(2 ** math.ceil(math.log2(piece)))


def host_memory(shape: ModelShape, c: Cluster, cand: Layout, seq_len: int = 0) -> dict[str, float]:
    """Host RAM per node, buffer by buffer as DeepSpeed 0.19 allocates them per rank (ZeRO-3: one pinned
    gradient-accumulation buffer, pinned bf16 parameter partitions per param group, a pinned gradient buffer per
    optimizer sub-group; pageable master weights and Adam moments, fp32 unless the JSON asks for bf16; under
    activation offload a pinned buffer per offloaded layer input of a micro-batch of `seq_len`), plus each rank's
    process."""
    psi, g, gpn = shape.num_params(), c.world, c.gpus_per_node
    part = psi / g  # parameters one rank owns
    pin, pageable = 0.0, 0.0
    subgroups = max(1, math.ceil(part / cand.sub_group))
    # bf16.bf16_master_weights_and_grads (DeepSpeed >= 0.19.1 with offload): master weights and the optimizer's
    # gradients in bf16; bf16_optimizer_states: Adam's moments too (host state ~10 -> ~6 bytes a parameter).
    master = 2 if cand.bf16_master else 4
    moments = cand.moment_bytes / 2 if cand.bf16_optimizer_states else cand.moment_bytes
    if cand.offload_optimizer == "cpu":
        if cand.stage == 3:
            pin += pinned((4 if cand.fp32_grad_accum else 2) * part)  # gradient accumulation buffer
            pin += pinned(master * part, subgroups)  # the optimizer's gradients, per sub-group
            pageable += (master + moments) * part  # master weights, Adam m and v
        else:
            pin += pinned(master * part) + pinned(master * part)  # the optimizer's gradients, master weights
            pageable += moments * part
    elif cand.offload_optimizer == "nvme":
        pin += pinned(4 * cand.sub_group * 4, 4)  # swap buffers
        pin += pinned(2 * part)
    if cand.offload_param == "cpu":
        pin += pinned(2 * part)  # bf16 partitions (the decay group)
    elif cand.offload_param == "nvme":
        pin += pinned(5 * 1e8 * 2, 5)
    if cand.offload_activations and cand.activation_checkpointing:
        layer_input = 2.0 * cand.micro_batch_size * seq_len // cand.sequence_parallel * shape.hidden_size
        moved = max(0, shape.num_layers - 1)  # all but the last (kept on the GPU)
        pin += pinned(layer_input * moved, moved) if moved else 0.0
    per_node_pinned, per_node_pageable = pin * gpn, pageable * gpn + RANK_HOST_OVERHEAD * gpn
    out = {
        "pinned": per_node_pinned,
        "pageable": per_node_pageable,
        "itemized": per_node_pinned + per_node_pageable,
        "deepspeed_estimate": 0.0,
    }
    if cand.offload_optimizer == "cpu" and cand.stage in (2, 3):
        cpu, _ = deepspeed_model_states(
            cand.stage, psi, shape.largest_layer_params(), gpn, c.nodes, True, cand.offload_param == "cpu"
        )
        out["deepspeed_estimate"] = float(cpu) + RANK_HOST_OVERHEAD * gpn
    # The start: without ZeRO-3 every rank builds the whole model in host memory before DeepSpeed takes it (in the
    # training dtype, pipeline.train.engine.build_for), its init drawing one fp32 tensor at a time; the steady
    # state's buffers come after.
    out["build"] = (build_bytes(shape) + RANK_HOST_OVERHEAD) * gpn if cand.stage < 3 else 0.0
    out["total"] = max(out["itemized"], out["build"])  # DeepSpeed's estimate (a flat 1.5x buffer) is shown beside it
    return out


def build_bytes(shape: ModelShape, dtype_bytes: int = 2) -> float:
    """Host bytes one rank holds while it builds the whole model (ZeRO 0-2): every parameter in the training
    dtype (bf16: 2 bytes), and while the init fills the largest tensor its fp32 draw and that draw's bf16 copy (6
    bytes an element), plus BUILD_SLACK. Measured on the CPU (tests/multiproc/test_build_memory.py, 2026-12-07):
    350m 0.90-0.93 GB against 0.98 planned, 1b 2.49-2.57 GB against 2.63; the fp32 build it replaced held 1.64-1.67
    and 4.68-4.72 GB."""
    return dtype_bytes * shape.num_params() + 6.0 * shape.largest_layer_params() + BUILD_SLACK


BUILD_SLACK = 32 * 2**20
"""What a build holds beyond its tensors (the allocator's arenas, the modules' Python objects): runs of one build
vary by up to 40 MB, and the term must not fall under them."""


def checkpoint_bytes(
    shape: ModelShape, stage: int, world: int, ranks_per_node: int, module_bytes: int = 2, state_bytes: float = 12.0
) -> dict[str, float]:
    """Bytes one DeepSpeed checkpoint puts on the busiest node (the first): every rank writes its optimizer shard
    (fp32 master weights and the optimizer's moments of the parameters it owns, `state_bytes` each: 12 for
    Adam), and for ZeRO 0-2 rank 0 also writes the whole 16-bit module (`module_bytes` 4 for fp32 runs).
    `weights_only` is the exported bf16 model."""
    psi = shape.num_params()
    per_node = state_bytes * psi / world * ranks_per_node + (module_bytes * psi if stage < 3 else 0.0)
    return {
        "per_node": per_node,
        "total": state_bytes * psi + (module_bytes * psi if stage < 3 else 0.0),
        "weights_only": 2.0 * psi,
    }


def inference_bytes(
    shape: ModelShape, seq_len: int, batch: int, world: int, loss_chunk_tokens: int, dense_mask: bool = False
) -> dict[str, float]:
    """Per-rank bytes of evaluating `batch` sequences in bf16: with the model split `world` ways under ZeRO-3
    (pipeline evaluate --num-gpus/--hostfile), the rank's partition and the gathered modules (the one computing and
    the one prefetched); on one card (`world` 1) the whole model, nothing gathered. Then the forward's transients
    (the MLP's gate, up and product alive at once; the residual stream, norm and attention outputs; q, k, v), one
    loss chunk's fp32 logits, the CUDA context. `dense_mask`: samples of whole documents through SDPA, whose
    (B, 1, T, T) boolean mask lives through the forward and becomes a bf16 additive bias inside each attention call
    (`mask` in the result). Transients carry the allocator's slack."""
    tokens = batch * seq_len
    kv = shape.num_kv_heads * shape.head_dim
    gathered = 2 * 2.0 * shape.largest_layer_params() if world > 1 else 0.0
    static = 2.0 * shape.num_params() / world + gathered
    mask = 3.0 * batch * seq_len**2 if dense_mask else 0.0
    transient = (
        3 * tokens * shape.ffn_hidden_size * 2
        + 4 * tokens * shape.hidden_size * 2
        + tokens * (shape.num_heads * shape.head_dim + 2 * kv) * 2
        + 2 * min(tokens, loss_chunk_tokens) * shape.vocab_size * 4
        + mask
    )
    total = static + transient * FRAGMENTATION + CUDA_CONTEXT
    return {"static": static, "transient": float(transient), "mask": mask, "total": total}


def evaluation_batch(
    shape: ModelShape,
    seq_len: int,
    requested: int,
    world: int,
    card_bytes: float,
    loss_chunk_tokens: int,
    dense_mask: bool = False,
) -> tuple[int, float]:
    """The largest batch, `requested` halved until it fits, whose inference bytes plus the margin stay within the
    card; (batch, bytes at that batch). Batch 0 when even one sequence does not fit."""
    margin = max(MARGIN_MIN_BYTES, MARGIN_FRACTION * card_bytes)
    batch = requested
    while batch >= 1:
        need = inference_bytes(shape, seq_len, batch, world, loss_chunk_tokens, dense_mask)["total"]
        if need + margin <= card_bytes:
            return batch, need
        batch //= 2
    return 0, inference_bytes(shape, seq_len, 1, world, loss_chunk_tokens, dense_mask)["total"]
