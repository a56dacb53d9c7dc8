"""Stage 3's training loop: resume or start, then step, log, validate and checkpoint until done or stopped.
Each part lives in its own module of `pipeline.train`; this file only puts them in order."""

from __future__ import annotations

import logging
import math
import signal
from dataclasses import dataclass
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
from pipeline.train import faults
from pipeline.train.config import PretrainConfig, dump
from pipeline.train.ds_config import BatchPlan, zero_stage
from pipeline.train.ds_workarounds import replay_adam_beta_powers
from pipeline.train.engine import build_engine
from pipeline.train.guards import NonFinite, Watchdog, checkpoint_size
from pipeline.train.metrics import MetricsSink, Throughput, format_line, mem_gib
from pipeline.train.resume import choose_resume, resume_problems
from pipeline.train.schedule import lr_at, max_steps_for
from pipeline.train.setup import Dist, apply_memory_cap, environment, init_distributed
from pipeline.train.step import micro_step_loss, train_step

log = logging.getLogger("pipeline.pretrain")


class StopFlag:
    """SIGTERM/SIGINT set a flag; the loop checks it (all ranks agree) after each step, saves and exits."""

    def __init__(self) -> None:
        self.requested = False
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True


@dataclass
class RunState:
    """What the loop carries: the engine, the data and the position in it."""

    engine: Any
    train_data: ShardedDataset
    val_data: ShardedDataset | None
    step: int
    consumed_samples: int
    resumed: bool


def train(cfg: PretrainConfig, ds: dict[str, Any], plan: BatchPlan, shape: ModelShape, manifest: ShardManifest) -> int:
    """Stage 3 on every rank: process group, resume or start, the loop, a final checkpoint."""
    import torch.distributed as tdist

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    env = init_distributed(cfg.train.comm_timeout_minutes)
    if env.device.type == "cpu":
        # Deterministic kernels make CPU runs repeat bit for bit (the resume tests rely on it). Not the NaN fill of
        # every fresh allocation that comes with deterministic mode: it only shows reads of uninitialised memory,
        # and it doubled the cost of DeepSpeed's per-micro-step bucket allocations.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    apply_memory_cap(env.device, cfg.train.gpu_memory_cap_gib)
    state = start_or_resume(cfg, ds, shape, manifest, env)
    fit(state, cfg, ds, plan, shape, manifest, env)
    if tdist.is_initialized():
        tdist.destroy_process_group()
    return 0


def start_or_resume(
    cfg: PretrainConfig, ds: dict[str, Any], shape: ModelShape, manifest: ShardManifest, env: Dist
) -> RunState:
    """Open the data, decide whether to resume (before anything heavy is built), build the engine, load the
    checkpoint, and write the resolved configs into the run folder."""
    import deepspeed.comm as dist

    run_dir = Path(cfg.run_dir)
    train_data = ShardedDataset(cfg.data.path, "train")
    if cfg.data.verify and env.rank == 0:
        train_data.verify()
    val_data = ShardedDataset(cfg.data.path, "val") if manifest["splits"]["val"]["samples"] else None
    if env.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    tag = resume_tag(cfg, run_dir, env, checkpoint_size(cfg, ds, shape, env) if cfg.checkpoint.enabled else 0.0)
    if tag and (
        problems := resume_problems(
            ckpt.read_marker(run_dir, tag),
            data_fingerprint=train_data.fingerprint,
            model_shape=shape.as_dict(),
            world_size=env.world_size,
            zero_stage=zero_stage(ds),
            nvme_optimizer=ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "nvme",
        )
    ):
        raise PipelineError(
            f"cannot resume {run_dir}/{tag}: " + "; ".join(problems) + " (use a new run_dir to start fresh)"
        )
    load_tag, engine_ds = tag, ds
    if tag and ckpt.read_marker(run_dir, tag)["world_size"] != env.world_size and zero_stage(ds) > 0:
        # Another world size: DeepSpeed's universal checkpoint re-partitions the optimizer states. Rank 0 converts
        # once (kept beside the checkpoint for the next launch); the engine loads it with load_universal.
        load_tag = universal_checkpoint(run_dir, tag, env)
        engine_ds = {**ds, "checkpoint": {**ds.get("checkpoint", {}), "load_universal": True}}
    engine = build_engine(cfg, engine_ds, shape, manifest["tokenizer"], env.rank)
    state = RunState(engine, train_data, val_data, 0, 0, resumed=tag is not None)
    if tag:
        engine.load_checkpoint(str(run_dir), tag=load_tag, load_optimizer_states=True, load_lr_scheduler_states=False)
        replay_adam_beta_powers(engine.optimizer, env.device)
        marker = ckpt.read_marker(run_dir, tag)
        state.step, state.consumed_samples = marker["step"], marker["consumed_samples"]
        if env.rank == 0:
            log.info(
                "resumed from %s/%s: step %d, %d samples consumed%s",
                run_dir,
                tag,
                state.step,
                state.consumed_samples,
                f" (saved by {marker['world_size']} ranks, now {env.world_size}: "
                f"through the universal checkpoint {load_tag})"
                if load_tag != tag
                else "",
            )
    if env.rank == 0:
        write_text(run_dir / "config.yaml", dump(cfg))
        write_json(run_dir / "ds_config.json", ds)
        write_json(run_dir / "environment.json", environment(env.world_size, env.device))
    return state


def universal_checkpoint(run_dir: Path, tag: str, env: Dist) -> str:
    """The universal form of checkpoint `tag` (rank 0 converts it once; every rank waits for it)."""
    import torch.distributed as tdist

    answer: list[Any] = [None, None]
    if env.rank == 0:
        try:
            answer[0], converted = ckpt.universal(run_dir, tag)
            if converted:
                log.info(
                    "converted %s/%s to DeepSpeed's universal checkpoint %s (once; kept for later launches)",
                    run_dir,
                    tag,
                    answer[0],
                )
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, not only rank 0
            answer[1] = f"converting {run_dir}/{tag} to a universal checkpoint failed: {type(e).__name__}: {e}"
    tdist.broadcast_object_list(answer, src=0)
    if answer[1]:
        raise PipelineError(answer[1])
    return str(answer[0])


def resume_tag(cfg: PretrainConfig, run_dir: Path, env: Dist, checkpoint_bytes: float) -> str | None:
    """The checkpoint this launch continues from: rank 0 reads the run folder (skipping complete checkpoints whose
    files are damaged, with a warning each) and every rank takes its answer, so all agree or all fail alike. Warns
    when the disk cannot hold `checkpoint.keep_last` checkpoints plus the next (`pipeline pretrain` refuses it)."""
    import torch.distributed as tdist

    answer: list[Any] = [None, [], None]  # tag, warnings, error
    if env.rank == 0:
        try:
            tags = ckpt.complete_tags(run_dir)
            tag = choose_resume(cfg.checkpoint.resume, tags, str(run_dir))
            if tag is not None and cfg.checkpoint.resume == "auto":
                tag, warnings = ckpt.newest_intact(run_dir, tags, cfg.checkpoint.verify)
                answer[:2] = [tag, warnings]
            elif tag is not None:
                if problem := ckpt.damage(run_dir, tag, cfg.checkpoint.verify):
                    raise PipelineError(f"checkpoint.resume {tag}: {problem}")
                answer[0] = tag
        except PipelineError as e:
            answer[2] = str(e)
        for w in answer[1]:
            log.warning("%s", w)
        if checkpoint_bytes and (problem := ckpt.space_problem(run_dir, checkpoint_bytes, cfg.checkpoint.keep_last)):
            log.warning("warning: %s", problem)
    tdist.broadcast_object_list(answer, src=0)
    if answer[2]:
        raise PipelineError(answer[2])
    return answer[0]


def fit(
    state: RunState,
    cfg: PretrainConfig,
    ds: dict[str, Any],
    plan: BatchPlan,
    shape: ModelShape,
    manifest: ShardManifest,
    env: Dist,
) -> None:
    """Step until `max_steps` or a stop signal: log, validate and checkpoint at their intervals."""
    import deepspeed.comm as dist

    run_dir, engine, device = Path(cfg.run_dir), state.engine, env.device
    max_steps = max_steps_for(cfg, plan)
    metrics = MetricsSink(
        run_dir, rank=env.rank, tensorboard=cfg.log.tensorboard, resumed_at=state.step if state.resumed else None
    )
    checkpointer = ckpt.Checkpointer(
        engine,
        run_dir,
        keep_last=cfg.checkpoint.keep_last,
        rank=env.rank,
        world_size=env.world_size,
        config=cfg.to_dict(),
        last_saved=state.step if state.resumed else -1,
        enabled=cfg.checkpoint.enabled,
        verify=cfg.checkpoint.verify,
        size_hint=checkpoint_size(cfg, ds, shape, env),
    )

    def marker() -> ckpt.Marker:
        return {
            "step": state.step,
            "consumed_samples": state.consumed_samples,
            "data_fingerprint": state.train_data.fingerprint,
            "seq_len": plan.seq_len,
            "tokenizer_sha256": manifest["tokenizer"]["sha256"],
            "model_shape": shape.as_dict(),
            "world_size": env.world_size,
        }

    batches = iter(
        build_loader(
            state.train_data,
            seed=cfg.train.seed,
            micro_batch_size=plan.micro_batch_size,
            data_parallel_size=env.world_size,
            rank=env.rank,
            consumed_samples=state.consumed_samples,
            num_workers=cfg.data.num_workers,
        )
    )
    stop = StopFlag()
    watchdog = Watchdog(cfg.train.comm_timeout_minutes * 60, env.rank)
    peak = peak_for(device, cfg.train.peak_tflops, env.rank)
    throughput = Throughput(state.step)
    nonfinite = NonFinite(cfg, state, plan, engine, env.rank)
    last_loss, trained = float("nan"), False
    engine.train()
    while state.step < max_steps:
        lr = lr_at(state.step, cfg, max_steps)
        poison = env.rank == 0 and faults.armed("NONFINITE_AT_STEP", state.step + 1)
        step_loss = train_step(engine, batches, plan.grad_accum, lr, device, poison=poison)
        state.step += 1
        state.consumed_samples += plan.global_batch_size
        throughput.add(plan.tokens_per_step)
        # One host sync per step: the mean loss over ranks and whether any rank was asked to stop.
        flag = torch.stack([step_loss, torch.tensor(float(stop.requested), dtype=torch.float64, device=device)])
        dist.all_reduce(flag)
        last_loss = flag[0].item() / env.world_size
        watchdog.beat()
        nonfinite.check(last_loss, run_dir)
        trained = True
        if state.step % cfg.log.interval == 0 or state.step == max_steps:
            tps, eta = throughput.take(state.step, max_steps)
            rec = step_record(state, engine, ds, plan, shape, env, loss=last_loss, lr=lr, tokens_per_s=tps, peak=peak)
            if env.rank == 0:
                log.info(format_line(rec, max_steps, eta))
            metrics.emit(rec)
        if (
            state.val_data is not None
            and cfg.eval.batches
            and (state.step % cfg.eval.interval == 0 or state.step == max_steps)
        ):
            val_loss = validate(engine, state.val_data, cfg, plan, env.rank, env.world_size, device)
            if env.rank == 0:
                log.info("step %d | val loss %.4f | val ppl %.2f", state.step, val_loss, math.exp(min(val_loss, 50)))
            metrics.emit({"step": state.step, "val_loss": val_loss})
        if state.step % cfg.checkpoint.interval == 0:
            with watchdog.paused():
                checkpointer.save(marker())
        if env.rank == 0 and faults.armed("KILL_AT_STEP", state.step):
            faults.kill_self()
        if flag[1].item() > 0:
            if checkpointer.last_saved != state.step:
                with watchdog.paused():
                    checkpointer.save(marker())
            if env.rank == 0:
                log.info("stopped by signal at step %d; checkpoint saved, resume with the same command", state.step)
            break
    if checkpointer.last_saved != state.step:
        with watchdog.paused():
            checkpointer.save(marker())
    watchdog.stop()
    metrics.close()
    dist.barrier()
    if env.rank == 0 and not trained:
        log.info("done: the run was already at step %d of %d; nothing to train", state.step, max_steps)
    elif env.rank == 0:
        log.info("done: step %d, final loss %.4f", state.step, last_loss)


def step_record(
    state: RunState,
    engine: Any,
    ds: dict[str, Any],
    plan: BatchPlan,
    shape: ModelShape,
    env: Dist,
    *,
    loss: float,
    lr: float,
    tokens_per_s: float,
    peak: float | None,
) -> dict[str, Any]:
    """One metrics line: loss, lr, gradient norm, throughput, TFLOP/s and MFU (PaLM count), memory."""
    tflops = tokens_per_s * shape.flops_per_token(plan.seq_len) / env.world_size / 1e12
    gnorm = engine.get_global_grad_norm()
    rec = {
        "step": state.step,
        "loss": loss,
        "lr": lr,
        "grad_norm": float(gnorm) if gnorm is not None else None,
        "tokens": state.consumed_samples * plan.seq_len,
        "tokens_per_s": tokens_per_s,
        "tflops_per_device": tflops,
        "mfu": tflops / peak if peak else None,
        "mem_gib": mem_gib(env.device),
    }
    if ds.get("fp16", {}).get("enabled"):
        rec["loss_scale"] = float(getattr(engine.optimizer, "cur_scale", getattr(engine.optimizer, "loss_scale", 0)))
        rec["skipped_steps"] = int(engine.skipped_steps)
    return rec


def peak_for(device: torch.device, override: float | None, rank: int) -> float | None:
    """The card's dense bf16 peak for MFU (PaLM count): `train.peak_tflops`, else the GPU table; None on the CPU
    and for a card the table does not know (MFU is then logged as n/a, with one warning)."""
    if override or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops_for_device(name)
    if peak is None and rank == 0:
        log.warning(
            "GPU '%s' is not in the planner's table: MFU is logged as n/a; set train.peak_tflops to the "
            "card's dense bf16 TFLOP/s to see it",
            name,
        )
    return peak


@torch.no_grad()
def validate(
    engine: Any,
    val_ds: ShardedDataset,
    cfg: PretrainConfig,
    plan: BatchPlan,
    rank: int,
    world: int,
    device: torch.device,
) -> float:
    """Mean token loss over the first `eval.batches` micro-batches per rank of the val split (fixed order)."""
    import deepspeed.comm as dist

    engine.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    it = rank_batches(len(val_ds), cfg.train.seed, plan.micro_batch_size, world, rank, 0)
    for _ in range(cfg.eval.batches):
        _, loss_total, tokens = micro_step_loss(engine, collate_samples(val_ds, next(it)), device)
        totals[0] += loss_total
        totals[1] += tokens
    dist.all_reduce(totals)
    engine.train()
    return float(totals[0] / totals[1].clamp(min=1))
