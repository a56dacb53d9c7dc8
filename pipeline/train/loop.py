"""The DeepSpeed side of stage 3: engine construction, the training loop, validation, checkpoints, signals.
With pipeline/pretrain.py (the launcher entry) the only code that imports deepspeed or torch.distributed."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.atomic import write_json, write_text
from pipeline.data.loader import ShardedDataset, build_loader, collate_samples, rank_batches
from pipeline.errors import PipelineError
from pipeline.model import ModelShape, llama_config
from pipeline.plan.gpus import peak_tflops_for_device
from pipeline.pretrain import lr_at, max_steps_for
from pipeline.train import checkpoint as ckpt
from pipeline.train.config import PretrainConfig, dump
from pipeline.train.ds_config import BatchPlan, zero_stage
from pipeline.train.ds_workarounds import release_shm_names, replay_adam_beta_powers
from pipeline.train.weights import init_weights, load_initial_weights

log = logging.getLogger("pipeline.pretrain")


def build_model(shape: ModelShape, ds: dict[str, Any], cfg: PretrainConfig, tok: dict[str, Any],
                rank: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    stage3 = zero_stage(ds) == 3
    lcfg = llama_config(shape, bos_id=max(tok.get("bos_id", 1), 0), eos_id=tok["eos_id"],
                        pad_id=tok["pad_id"] if tok.get("pad_id", -1) >= 0 else None)
    torch.manual_seed(cfg.train.seed)
    if stage3:
        import contextlib

        import deepspeed

        with contextlib.ExitStack() as stack:
            # As transformers' own zero.Init path does: skip the throwaway default init (we init below) and keep
            # RoPE's arange in fp32; both helpers are transformers internals, so degrade gracefully without them.
            try:
                from transformers.initialization import no_init_weights
                from transformers.integrations.deepspeed import prevent_arange_dtype_change

                stack.enter_context(no_init_weights())
                stack.enter_context(prevent_arange_dtype_change())
            except ImportError:
                log.warning("transformers lacks its zero.Init helpers; RoPE buffers may be built in bf16")
            # Partitions each parameter as it is created: no rank ever holds the whole model.
            stack.enter_context(deepspeed.zero.Init(config_dict_or_path=ds))
            model = LlamaForCausalLM(lcfg)
    else:
        model = LlamaForCausalLM(lcfg)
    if cfg.model.init_from:
        load_initial_weights(model, cfg.model.init_from, rank, stage3)
    else:
        init_weights(model, cfg.train.seed, rank, stage3)
    if cfg.train.activation_checkpointing:
        # Non-reentrant: the reentrant variant breaks with ZeRO-3 (DeepSpeed PR #7780).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def build_engine(cfg: PretrainConfig, ds: dict[str, Any], shape: ModelShape, manifest: dict[str, Any],
                 rank: int) -> Any:
    """The one place a DeepSpeed engine is made: model (under zero.Init for ZeRO-3), optimizer, engine."""
    import deepspeed

    model = build_model(shape, ds, cfg, manifest["tokenizer"], rank)
    client_optimizer = None
    if cfg.optim.name == "adamw8bit":
        import bitsandbytes as bnb

        client_optimizer = bnb.optim.AdamW8bit(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                               betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)
    _check_aio(ds)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=client_optimizer,
        model_parameters=None if client_optimizer else param_groups(model, cfg.optim.weight_decay),  # type: ignore[arg-type]
        config=ds)
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


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """Cross-entropy over real tokens only (labels -100 are padding); logits (B, T, V), labels (B, T).

    Returns (mean loss to backpropagate, the summed loss as a float, token count). The float is summed in float64
    in a fixed order: a vectorised float32 sum can round differently with the buffer's memory alignment, which
    would make a resumed run's logged loss differ from the uninterrupted one by an ulp."""
    per_token = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100,
                                reduction="none")  # (B*T,), 0 where ignored
    count = int((labels != -100).sum())
    exact = float(per_token.detach().double().cumsum(0)[-1]) if per_token.numel() else 0.0
    return per_token.sum() / max(count, 1), exact, count


class _Stop:
    """SIGTERM/SIGINT set a flag; the loop checks it (all ranks agree) after each step, saves and exits."""

    def __init__(self) -> None:
        self.requested = False
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True


def _mem_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB; host RSS on CPU


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    h, m = divmod(int(seconds) // 60, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{int(seconds) % 60:02d}s"


def train(cfg: PretrainConfig, ds: dict[str, Any], plan: BatchPlan, shape: ModelShape,
          manifest: dict[str, Any]) -> int:
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from datetime import timedelta

    deepspeed.init_distributed(timeout=timedelta(minutes=cfg.train.comm_timeout_minutes))
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank has mapped every shared-memory buffer by now
    release_shm_names(rank)
    accel = get_accelerator()
    device = torch.device(accel.device_name(), accel.current_device()) if accel.device_name() != "cpu" \
        else torch.device("cpu")
    if accel.device_name() == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    elif cfg.train.gpu_memory_cap_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.train.gpu_memory_cap_gib * 2**30 / total), device)
    run_dir = Path(cfg.run_dir)
    max_steps = max_steps_for(cfg, plan)
    stage = zero_stage(ds)

    train_ds = ShardedDataset(cfg.data.path, "train")
    if cfg.data.verify and rank == 0:
        train_ds.verify()
    val_ds = ShardedDataset(cfg.data.path, "val") if manifest["splits"]["val"]["samples"] else None

    # Resume decision, before building anything heavy.
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    resume_tag = None
    if cfg.checkpoint.resume == "auto":
        resume_tag = ckpt.latest_complete(run_dir)
    elif cfg.checkpoint.resume == "never":
        if ckpt.latest_complete(run_dir):
            raise PipelineError(f"{run_dir} holds checkpoints but checkpoint.resume is never; use another run_dir "
                                "or resume: auto")
    else:
        resume_tag = cfg.checkpoint.resume
        if resume_tag not in ckpt.complete_tags(run_dir):
            raise PipelineError(f"checkpoint.resume {resume_tag}: no complete checkpoint of that tag in {run_dir}")
    shape_dict = shape.as_dict()
    if resume_tag:
        marker = ckpt.read_marker(run_dir, resume_tag)
        problems = []
        if marker["data_fingerprint"] != train_ds.fingerprint:
            problems.append(f"data fingerprint {train_ds.fingerprint} differs from the checkpoint's "
                            f"{marker['data_fingerprint']} (other shards, seq_len or seed)")
        if marker["model_shape"] != shape_dict:
            problems.append(f"model shape {shape_dict} differs from the checkpoint's {marker['model_shape']}")
        if marker["world_size"] != world and stage > 0:
            problems.append(f"world size {world} differs from the checkpoint's {marker['world_size']}: ZeRO-{stage} "
                            "optimizer partitions are per rank; convert with DeepSpeed's ds_to_universal first")
        if problems:
            raise PipelineError(f"cannot resume {run_dir}/{resume_tag}: " + "; ".join(problems) +
                                " (use a new run_dir to start fresh)")

    engine = build_engine(cfg, ds, shape, manifest, rank)

    step, consumed = 0, 0
    if resume_tag:
        engine.load_checkpoint(str(run_dir), tag=resume_tag, load_optimizer_states=True,
                               load_lr_scheduler_states=False)
        replay_adam_beta_powers(engine.optimizer, device)
        marker = ckpt.read_marker(run_dir, resume_tag)
        step, consumed = int(marker["step"]), int(marker["consumed_samples"])
        if rank == 0:
            log.info("resumed from %s/%s: step %d, %d samples consumed", run_dir, resume_tag, step, consumed)
            _truncate_metrics(run_dir / "metrics.jsonl", step)
    if rank == 0:
        write_text(run_dir / "config.yaml", dump(cfg))
        write_json(run_dir / "ds_config.json", ds)

    writer = None
    if rank == 0 and cfg.log.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(run_dir / "tb"))
    metrics = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None

    loader = build_loader(train_ds, seed=cfg.train.seed, micro_batch_size=plan.micro_batch_size,
                          data_parallel_size=world, rank=rank, consumed_samples=consumed,
                          num_workers=cfg.data.num_workers)
    batches = iter(loader)
    stop = _Stop()
    peak = peak_tflops_for_device(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    flops_per_token = shape.flops_per_token(plan.seq_len)
    last_saved = step if resume_tag else -1

    def save(at: int) -> None:
        nonlocal last_saved
        tag = ckpt.tag_for(at)
        client = {"step": at, "consumed_samples": consumed, "data_fingerprint": train_ds.fingerprint,
                  "seq_len": plan.seq_len, "tokenizer_sha256": manifest["tokenizer"]["sha256"],
                  "model_shape": shape_dict, "world_size": world, "config": cfg.to_dict()}
        engine.save_checkpoint(str(run_dir), tag=tag, client_state=client, save_latest=False)
        dist.barrier()
        if rank == 0:
            ckpt.mark_complete(run_dir, tag, {k: v for k, v in client.items() if k != "config"})
            ckpt.prune(run_dir, cfg.checkpoint.keep_last)
            log.info("saved checkpoint %s/%s", run_dir, tag)
        dist.barrier()
        last_saved = at

    def emit(record: dict[str, Any]) -> None:
        if metrics is not None:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if writer is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    writer.add_scalar(k, v, record["step"])

    engine.train()
    t_log, tokens_since, losses = time.perf_counter(), 0, []
    t_start, start_step = time.perf_counter(), step
    while step < max_steps:
        lr = lr_at(step, cfg, max_steps)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for _ in range(plan.grad_accum):
            batch = next(batches)
            logits = engine(input_ids=batch["input_ids"].to(device)).logits
            loss, loss_total, tokens = lm_loss(logits, batch["labels"].to(device))
            engine.backward(loss)
            engine.step()
            loss_sum += loss_total / max(tokens, 1)
        step += 1
        consumed += plan.global_batch_size
        tokens_since += plan.tokens_per_step
        flag = torch.tensor([loss_sum / plan.grad_accum, float(stop.requested)], dtype=torch.float64,
                            device=device)
        dist.all_reduce(flag)
        mean_loss = flag[0].item() / world
        losses.append(mean_loss)
        if step % cfg.log.interval == 0 or step == max_steps:
            dt = time.perf_counter() - t_log
            tps = tokens_since / dt
            tflops = tps * flops_per_token / world / 1e12
            gnorm = engine.get_global_grad_norm()
            gnorm = float(gnorm) if gnorm is not None else None
            eta = (time.perf_counter() - t_start) / max(1, step - start_step) * (max_steps - step)
            rec = {"step": step, "loss": mean_loss, "lr": lr, "grad_norm": gnorm, "tokens": consumed * plan.seq_len,
                   "tokens_per_s": tps, "tflops_per_device": tflops,
                   "mfu": tflops / peak if peak else None, "mem_gib": _mem_gib(device)}
            if ds.get("fp16", {}).get("enabled"):
                rec["loss_scale"] = float(getattr(engine.optimizer, "cur_scale", getattr(engine.optimizer,
                                                                                         "loss_scale", 0)))
                rec["skipped_steps"] = int(engine.skipped_steps)
            if rank == 0:
                mfu = f"{rec['mfu']:.1%}" if peak else "n/a"
                gn = f"{gnorm:.3f}" if gnorm is not None else "n/a"
                log.info("step %d/%d | loss %.4f | lr %.2e | gnorm %s | tok/s %.1f | tflops %.2f | mfu %s | "
                         "mem %.2fG | eta %s", step, max_steps, mean_loss, lr, gn, tps, tflops, mfu,
                         rec["mem_gib"], _fmt_eta(eta))
            emit(rec)
            t_log, tokens_since = time.perf_counter(), 0
        if val_ds is not None and cfg.eval.batches and (step % cfg.eval.interval == 0 or step == max_steps):
            val_loss = validate(engine, val_ds, cfg, plan, rank, world, device)
            if rank == 0:
                log.info("step %d | val loss %.4f | val ppl %.2f", step, val_loss, math.exp(min(val_loss, 50)))
            emit({"step": step, "val_loss": val_loss})
        if step % cfg.checkpoint.interval == 0:
            save(step)
        if flag[1].item() > 0:
            if last_saved != step:
                save(step)
            if rank == 0:
                log.info("stopped by signal at step %d; checkpoint saved, resume with the same command", step)
            break
    if last_saved != step:
        save(step)
    if writer is not None:
        writer.close()
    if metrics is not None:
        metrics.close()
    dist.barrier()
    if rank == 0:
        log.info("done: step %d, final loss %.4f", step, losses[-1] if losses else float("nan"))
    import torch.distributed as tdist

    if tdist.is_initialized():
        tdist.destroy_process_group()
    return 0


@torch.no_grad()
def validate(engine: Any, val_ds: ShardedDataset, cfg: PretrainConfig, plan: BatchPlan, rank: int, world: int,
             device: torch.device) -> float:
    """Mean token loss over the first `eval.batches` micro-batches per rank of the val split (fixed order)."""
    import deepspeed.comm as dist

    engine.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    it = rank_batches(len(val_ds), cfg.train.seed, plan.micro_batch_size, world, rank, 0)
    for _ in range(cfg.eval.batches):
        batch = collate_samples(val_ds, next(it))
        logits = engine(input_ids=batch["input_ids"].to(device)).logits
        labels = batch["labels"].to(device)
        _, loss_total, tokens = lm_loss(logits, labels)
        totals[0] += loss_total
        totals[1] += tokens
    totals = totals.to(device)
    dist.all_reduce(totals)
    engine.train()
    return float(totals[0] / totals[1].clamp(min=1))


def _check_aio(ds: dict[str, Any]) -> None:
    zero = ds.get("zero_optimization", {})
    if any(zero.get(k, {}).get("device") == "nvme" for k in ("offload_optimizer", "offload_param")):
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible():
            raise PipelineError("NVMe offload needs DeepSpeed's async_io op, which cannot build here (install "
                                "libaio-dev, then check `ds_report`); or use ds_configs/zero3_offload.json (CPU)")
        for k in ("offload_optimizer", "offload_param"):
            path = zero.get(k, {}).get("nvme_path")
            if path and not os.access(path, os.W_OK):
                raise PipelineError(f"zero_optimization.{k}.nvme_path {path}: not a writable folder on this node")


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop metric lines past the checkpoint so the file reads as one continuous run."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
    write_text(path, "".join(line + "\n" for line in keep))

