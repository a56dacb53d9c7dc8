"""Stage 3's training loop: resume or start, then step, log, validate and checkpoint until done or stopped.
Each part lives in its own module of `pipeline.train`; this file only puts them in order."""

from __future__ import annotations

import logging
import math
import signal
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import write_json, write_text
from pipeline.data.loader import ShardedDataset, build_loader, collate_samples, rank_batches
from pipeline.data.manifest import ShardManifest
from pipeline.errors import PipelineError
from pipeline.model import ModelShape
from pipeline.plan.gpus import peak_tflops_for_device
from pipeline.train import checkpoint as ckpt
from pipeline.train.config import PretrainConfig, dump
from pipeline.train.ds_config import BatchPlan, zero_stage
from pipeline.train.ds_workarounds import replay_adam_beta_powers
from pipeline.train.engine import build_engine
from pipeline.train.metrics import MetricsSink, Throughput, format_line, mem_gib
from pipeline.train.resume import choose_resume, resume_problems
from pipeline.train.schedule import lr_at, max_steps_for
from pipeline.train.setup import apply_memory_cap, init_distributed
from pipeline.train.step import lm_loss, train_step

log = logging.getLogger("pipeline.pretrain")


class StopFlag:
    """SIGTERM/SIGINT set a flag; the loop checks it (all ranks agree) after each step, saves and exits."""

    def __init__(self) -> None:
        self.requested = False
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True


def train(cfg: PretrainConfig, ds: dict[str, Any], plan: BatchPlan, shape: ModelShape,
          manifest: ShardManifest) -> int:
    import deepspeed.comm as dist

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    env = init_distributed(cfg.train.comm_timeout_minutes)
    rank, world, device = env.rank, env.world_size, env.device
    if device.type == "cpu":
        # Deterministic kernels make CPU runs repeat bit for bit (the resume tests rely on it). Not the NaN fill of
        # every fresh allocation that comes with deterministic mode: it only shows reads of uninitialised memory,
        # and it doubled the cost of DeepSpeed's per-micro-step bucket allocations.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    apply_memory_cap(device, cfg.train.gpu_memory_cap_gib)
    run_dir = Path(cfg.run_dir)
    max_steps = max_steps_for(cfg, plan)

    train_ds = ShardedDataset(cfg.data.path, "train")
    if cfg.data.verify and rank == 0:
        train_ds.verify()
    val_ds = ShardedDataset(cfg.data.path, "val") if manifest["splits"]["val"]["samples"] else None

    # The resume decision comes before anything heavy is built.
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    resume_tag = choose_resume(cfg.checkpoint.resume, ckpt.complete_tags(run_dir), str(run_dir))
    if resume_tag and (problems := resume_problems(
            ckpt.read_marker(run_dir, resume_tag), data_fingerprint=train_ds.fingerprint,
            model_shape=shape.as_dict(), world_size=world, zero_stage=zero_stage(ds))):
        raise PipelineError(f"cannot resume {run_dir}/{resume_tag}: " + "; ".join(problems) +
                            " (use a new run_dir to start fresh)")

    engine = build_engine(cfg, ds, shape, manifest["tokenizer"], rank)
    step, consumed = 0, 0
    if resume_tag:
        engine.load_checkpoint(str(run_dir), tag=resume_tag, load_optimizer_states=True,
                               load_lr_scheduler_states=False)
        replay_adam_beta_powers(engine.optimizer, device)
        marker = ckpt.read_marker(run_dir, resume_tag)
        step, consumed = marker["step"], marker["consumed_samples"]
        if rank == 0:
            log.info("resumed from %s/%s: step %d, %d samples consumed", run_dir, resume_tag, step, consumed)
    if rank == 0:
        write_text(run_dir / "config.yaml", dump(cfg))
        write_json(run_dir / "ds_config.json", ds)

    metrics = MetricsSink(run_dir, rank=rank, tensorboard=cfg.log.tensorboard,
                          resumed_at=step if resume_tag else None)
    checkpointer = ckpt.Checkpointer(engine, run_dir, keep_last=cfg.checkpoint.keep_last, rank=rank,
                                     config=cfg.to_dict(), last_saved=step if resume_tag else -1,
                                     enabled=cfg.checkpoint.enabled)
    marker_base = {"data_fingerprint": train_ds.fingerprint, "seq_len": plan.seq_len,
                   "tokenizer_sha256": manifest["tokenizer"]["sha256"], "model_shape": shape.as_dict(),
                   "world_size": world}

    def marker_now() -> ckpt.Marker:
        return {"step": step, "consumed_samples": consumed, **marker_base}  # type: ignore[typeddict-item]

    batches = iter(build_loader(train_ds, seed=cfg.train.seed, micro_batch_size=plan.micro_batch_size,
                                data_parallel_size=world, rank=rank, consumed_samples=consumed,
                                num_workers=cfg.data.num_workers))
    stop = StopFlag()
    peak = peak_for(device, cfg.train.peak_tflops, rank)
    flops_per_token = shape.flops_per_token(plan.seq_len)
    throughput = Throughput(step)
    last_loss = float("nan")
    engine.train()
    while step < max_steps:
        lr = lr_at(step, cfg, max_steps)
        step_loss = train_step(engine, batches, plan.grad_accum, lr, device)
        step += 1
        consumed += plan.global_batch_size
        throughput.add(plan.tokens_per_step)
        # One host sync per step: the mean loss over ranks and whether any rank was asked to stop.
        flag = torch.stack([step_loss, torch.tensor(float(stop.requested), dtype=torch.float64, device=device)])
        dist.all_reduce(flag)
        last_loss = flag[0].item() / world
        if step % cfg.log.interval == 0 or step == max_steps:
            tps, eta = throughput.take(step, max_steps)
            tflops = tps * flops_per_token / world / 1e12
            gnorm = engine.get_global_grad_norm()
            rec = {"step": step, "loss": last_loss, "lr": lr, "grad_norm": float(gnorm) if gnorm is not None else None,
                   "tokens": consumed * plan.seq_len, "tokens_per_s": tps, "tflops_per_device": tflops,
                   "mfu": tflops / peak if peak else None, "mem_gib": mem_gib(device)}
            if ds.get("fp16", {}).get("enabled"):
                rec["loss_scale"] = float(getattr(engine.optimizer, "cur_scale",
                                                  getattr(engine.optimizer, "loss_scale", 0)))
                rec["skipped_steps"] = int(engine.skipped_steps)
            if rank == 0:
                log.info(format_line(rec, max_steps, eta))
            metrics.emit(rec)
        if val_ds is not None and cfg.eval.batches and (step % cfg.eval.interval == 0 or step == max_steps):
            val_loss = validate(engine, val_ds, cfg, plan, rank, world, device)
            if rank == 0:
                log.info("step %d | val loss %.4f | val ppl %.2f", step, val_loss, math.exp(min(val_loss, 50)))
            metrics.emit({"step": step, "val_loss": val_loss})
        if step % cfg.checkpoint.interval == 0:
            checkpointer.save(marker_now())
        if flag[1].item() > 0:
            if checkpointer.last_saved != step:
                checkpointer.save(marker_now())
            if rank == 0:
                log.info("stopped by signal at step %d; checkpoint saved, resume with the same command", step)
            break
    if checkpointer.last_saved != step:
        checkpointer.save(marker_now())
    metrics.close()
    dist.barrier()
    if rank == 0:
        log.info("done: step %d, final loss %.4f", step, last_loss)
    import torch.distributed as tdist

    if tdist.is_initialized():
        tdist.destroy_process_group()
    return 0


def peak_for(device: torch.device, override: float | None, rank: int) -> float | None:
    """The card's dense bf16 peak for MFU (PaLM count): `train.peak_tflops`, else the GPU table; None on the CPU
    and for a card the table does not know (MFU is then logged as n/a, with one warning)."""
    if override or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops_for_device(name)
    if peak is None and rank == 0:
        log.warning("GPU '%s' is not in the planner's table: MFU is logged as n/a; set train.peak_tflops to the "
                    "card's dense bf16 TFLOP/s to see it", name)
    return peak


@torch.no_grad()
def validate(engine: Any, val_ds: ShardedDataset, cfg: PretrainConfig, plan: BatchPlan, rank: int, world: int,
             device: torch.device) -> float:
    """Mean token loss over the first `eval.batches` micro-batches per rank of the val split (fixed order)."""
    import deepspeed.comm as dist

    engine.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    it = rank_batches(len(val_ds), cfg.train.seed, plan.micro_batch_size, world, rank, 0)
    for _ in range(cfg.eval.batches):
        batch = collate_samples(val_ds, next(it))
        logits = engine(input_ids=batch["input_ids"].to(device, non_blocking=True)).logits
        _, loss_total, tokens = lm_loss(logits, batch["labels"])
        totals[0] += loss_total
        totals[1] += tokens
    dist.all_reduce(totals)
    engine.train()
    return float(totals[0] / totals[1].clamp(min=1))
