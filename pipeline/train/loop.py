"""Stage 3's training loop on every rank: the trainer opens the data, has the checkpointer build and resume the
engine, then `fit` steps until done or stopped and calls the parts that own their policy (the step logger, the
validator, the checkpointer, the non-finite guard, the watchdog). Each part lives in its own module of
`pipeline.train`; this file only puts them in order."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import sealed_text, write_json, write_text
from pipeline.data.loader import ShardedDataset, build_loader
from pipeline.errors import EXIT_STOPPED
from pipeline.train import faults
from pipeline.train.checkpoint.checkpointer import Checkpointer
from pipeline.train.engine import activation_offload, build_engine, choose_speed
from pipeline.train.parts.guards import NonFinite, Watchdog
from pipeline.train.parts.memory_peak import PeakRecorder
from pipeline.train.parts.metrics import MetricsSink, StepLogger
from pipeline.train.parts.tracking import Trackers
from pipeline.train.parts.validate import Validator
from pipeline.train.preflight import verify_shards
from pipeline.train.runtime import ops
from pipeline.train.runtime.dist import (
    apply_memory_cap,
    environment,
    init_distributed,
    make_deterministic_on_cpu,
    on_rank0,
    rank_facts,
    ranks_per_node,
    share_cpu_cores,
)
from pipeline.train.runtime.ds_workarounds import sequence_parallel_loss_factor
from pipeline.train.setup.config import dump_for_the_run
from pipeline.train.setup.optimizers import OPTIMIZERS
from pipeline.train.setup.prepare import Prepared, Run
from pipeline.train.setup.runlock import LOCK_NAME, RunLock
from pipeline.train.setup.schedule import Schedule, lr_at, max_steps_for
from pipeline.train.setup.stages import Stage, stage_at, stages
from pipeline.train.state import Part, StepEnd, TrainState
from pipeline.train.step import train_step

log = logging.getLogger(__name__)


@contextlib.contextmanager
def announced_op_builds(run: Run) -> Iterator[None]:
    """DeepSpeed JIT-compiles an op its engine needs the first time it loads in an environment, for a minute or
    more, printing nothing; the first rank of each node says so, and for how long it took. (`pipeline pretrain`
    builds them ahead on the launching node.)"""
    local = ranks_per_node(run.dist.world_size)
    accelerator = "cpu" if run.dist.device.type == "cpu" else "cuda"
    todo = [n for n in ops.needed(run.layout, accelerator, local) if not ops.is_built(n)]
    speak = bool(todo) and int(os.environ.get("LOCAL_RANK", "0")) == 0
    if speak:
        log.info(
            "%s: building DeepSpeed's %s op(s) for this environment (once; about a minute each)",
            socket.gethostname(),
            ", ".join(todo),
        )
    started = time.monotonic()
    yield
    if speak:
        log.info("%s: built %s in %.0f s", socket.gethostname(), ", ".join(todo), time.monotonic() - started)


def say_activation_offload(stats: Any, device: torch.device) -> None:
    """After the first step: what activation offload moved in its last micro-step (it says nothing itself)."""
    where = " (none: the CPU accelerator has no streams and nothing to move)" if device.type == "cpu" else ""
    log.info(
        "activation offload: %d of %d checkpointed layer inputs moved to host memory per micro-step (%.0f MiB)%s",
        stats.offloaded_tensors,
        stats.marked_tensors,
        stats.offloaded_bytes / 2**20,
        where,
    )


class StopFlag:
    """SIGTERM/SIGINT set a flag; the loop checks it (all ranks agree) after each step, saves and exits."""

    def __init__(self) -> None:
        self.requested = False
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True


def train(prepared: Prepared) -> int:
    """Stage 3 on every rank: process group, resume or start, the loop, a final checkpoint."""
    import torch.distributed as tdist

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # The watchdog ends a rank that makes no progress within train.comm_timeout_minutes, with a message that says so;
    # a collective may wait twice that before it raises, so the watchdog always speaks first.
    run = Run.on(prepared, init_distributed(2 * prepared.cfg.train.comm_timeout_minutes))
    make_deterministic_on_cpu(run.dist.device)
    apply_memory_cap(run.dist.device, run.cfg.train.gpu_memory_cap_gib)
    trainer = Trainer(run)
    try:
        trainer.fit()
    finally:
        trainer.close()
    if tdist.is_initialized():
        tdist.destroy_process_group()
    return EXIT_STOPPED if trainer.stopped_early else 0


class Trainer:
    """One rank's run: the data, the engine (built and resumed by the checkpointer), where the run stands, and
    the parts the loop calls."""

    def __init__(self, run: Run):
        self.run = run
        self.stopped_early = False
        cfg, rank = run.cfg, run.dist.rank
        self.train_data = ShardedDataset(cfg.data.path, "train")
        self.stage = stages(cfg.data)[0]
        has_val = run.manifest["splits"]["val"]["samples"]
        self.val_data = ShardedDataset(cfg.data.path, "val") if has_val else None
        if cfg.data.verify:
            splits = [self.train_data] + ([self.val_data] if self.val_data is not None else [])
            splits += [ShardedDataset(stage.path, "train") for stage in stages(cfg.data)[1:]]
            here = run.run_dir if run.run_dir.is_dir() else None
            on_rank0(lambda: verify_shards(splits, here))  # every rank exits with rank 0's answer
        if not has_val and cfg.eval.interval and cfg.eval.batches and rank == 0:
            log.warning(
                "warning: %s has no val split (sharded with --split %s): this run trains without a validation loss",
                cfg.data.path,
                ",".join(f"{x:g}" for x in run.manifest.get("split_ratios", [])),
            )
        self.lock = RunLock(run.run_dir)
        self._created = False

        def own_the_run_folder() -> None:
            self._created = not run.run_dir.exists()
            run.run_dir.mkdir(parents=True, exist_ok=True)
            self.lock.acquire()  # one live training per run folder, until rank 0's process ends

        on_rank0(own_the_run_folder)
        self.memory = PeakRecorder(run.dist.rank, run.dist.device.type)  # the bench's PIPELINE_MEMORY_SNAPSHOT
        try:
            self._start()
        except BaseException:
            self._leave_nothing()
            raise

    def _leave_nothing(self) -> None:
        """A launch that fails before it trained leaves no run folder it created (only its lock would be there)."""
        self.lock.release()
        run_dir = self.run.run_dir
        if self._created and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {LOCK_NAME, "logs"}:
            shutil.rmtree(run_dir, ignore_errors=True)

    def _start(self) -> None:
        """The engine, built and resumed; what the run ran on; the metrics sink."""
        import torch.distributed as tdist

        run = self.run
        cfg, rank = run.cfg, run.dist.rank
        if run.layout.offload_optimizer != "none":
            share_cpu_cores(ranks_per_node(run.dist.world_size))
        self.watchdog = Watchdog(cfg.train.comm_timeout_minutes * 60, rank, run.run_dir / "logs" / "launch.log")
        self.checkpointer = Checkpointer(run, data_fingerprint=self.train_data.fingerprint, watchdog=self.watchdog)
        speed = choose_speed(
            cfg, run.layout, run.shape, run.plan.micro_batch_size, run.plan.seq_len, run.dist.device, run.documents
        )
        if rank == 0:
            tiles = run.layout.tiled_mlp
            long_context = [run.plan.sequence_note] if run.layout.sequence_parallel > 1 else []
            long_context += [f"tiled MLP: each layer's MLP in {tiles} tiles along the sequence"] if tiles > 1 else []
            if self.train_data.document_masks:
                long_context += [
                    "documents: whole, several to a sample; attention and the loss stay inside each (positions "
                    "restart at each document's start)"
                ]
            for note in [Schedule.of(cfg).describe(max_steps_for(cfg, run.plan))] + speed.notes() + long_context:
                log.info("%s", note)
        with announced_op_builds(run):
            self.engine, marker = self.checkpointer.resume(
                lambda ds: build_engine(cfg, ds, run.layout, run.shape, run.manifest["tokenizer"], rank, speed)
            )
        self.state = TrainState(marker["step"], marker["consumed_samples"], True) if marker else TrainState()
        if rank == 0 and self.checkpointer.branched_from is not None:
            history = self.checkpointer.branched_from.parent / "metrics.jsonl"
            if history.exists() and not (run.run_dir / "metrics.jsonl").exists():
                shutil.copyfile(history, run.run_dir / "metrics.jsonl")  # the source's steps, cut at the branch below
        self._enter_stage(stage_at(cfg.data, self.state.step))
        ranks: list[Any] = [None] * run.dist.world_size
        tdist.all_gather_object(ranks, rank_facts(run.dist))
        if rank == 0:
            write_text(run.run_dir / "config.yaml", sealed_text(dump_for_the_run(cfg, Path.cwd())))
            write_json(run.run_dir / "ds_config.json", run.ds)
            env = environment(run.dist.world_size, run.dist.device)
            env["optimizer"] = type(self.engine.optimizer).__name__  # which of DeepSpeed's it chose
            inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
            groups = [
                f"{g.get('name', f'group {i}')}: {len(g['params'])} tensors at {g.get('lr_scale', 1.0):g}x the "
                "schedule's lr"
                for i, g in enumerate(inner.param_groups)
            ]
            log.info("optimizer %s (%s); %s", cfg.optim.name, type(inner).__name__, "; ".join(groups))
            if clip_note := OPTIMIZERS[cfg.optim.name].clip_note:
                log.info("gradient clipping off: %s", clip_note)
            env["grad_accum_dtype"] = (run.ds.get("data_types") or {}).get("grad_accum_dtype") or "model dtype"
            env["ranks"] = ranks
            env["speed"] = speed.record()
            env["long_context"] = {"sequence_parallel": run.layout.sequence_parallel, "tiled_mlp": run.layout.tiled_mlp}
            if run.planned is not None:  # deepspeed_config auto: who searched the layout this run trains
                env["planned_by"] = run.planned.by
            write_json(run.run_dir / "environment.json", env)
        self.max_steps = max_steps_for(cfg, run.plan)
        self.backward_scale = sequence_parallel_loss_factor(run.layout.stage, run.layout.sequence_parallel)
        self.sink = MetricsSink(
            run.run_dir,
            rank=rank,
            tensorboard=cfg.log.tensorboard,
            resumed_at=self.state.step if self.state.resumed else None,
            trackers=Trackers.factory(cfg, run.run_dir),
        )

    def fit(self) -> None:
        """Step until `max_steps` or a stop signal; each part decides for itself whether its interval is due."""
        import deepspeed.comm as dist

        run, state, engine = self.run, self.state, self.engine
        batches, stop, start = self._batches(), StopFlag(), state.step
        logger = StepLogger(run, engine, self.sink, state.step, self.max_steps)
        validator = Validator(run, self.val_data, self.sink, self.max_steps, progress=self.watchdog.beat)
        nonfinite = NonFinite(
            run.cfg,
            run.plan,
            run.dist.rank,
            len(self.train_data),
            int(engine.skipped_steps),
            resumed_at=start if state.resumed else None,
            run_dir=run.run_dir,
        )
        # The loop's parts, in the order they act after each step (a non-finite step stops before it is logged
        # or saved; a due save comes before a test's kill): each decides for itself whether its interval is due.
        parts: list[Part] = [
            nonfinite,
            logger,
            self.memory,
            validator,
            self.checkpointer,
            faults.KillAtStep(run.dist.rank),
        ]
        offload = activation_offload(run.layout, run.dist.device)
        self.watchdog.start()
        engine.train()
        loss = float("nan")
        while state.step < self.max_steps:
            if (stage := stage_at(run.cfg.data, state.step)) != self.stage:
                self._enter_stage(stage)
                batches = self._batches()
            lr = lr_at(state.step, run.cfg, self.max_steps)
            loss, stopping, timings = self._step(batches, lr, stop.requested, offload, first=state.step == start)
            self.watchdog.beat()
            end = StepEnd(state, loss, lr, int(engine.skipped_steps), stopping, timings, engine)
            for part in parts:
                part.after_step(end)
            if stopping:
                self._stopped()
                break
        for part in parts:
            part.at_end(state)
        dist.barrier()
        if run.dist.rank == 0 and state.step == start:
            log.info("done: the run was already at step %d of %d; nothing to train", state.step, self.max_steps)
        elif run.dist.rank == 0 and not self.stopped_early:
            log.info("done: step %d, final loss %.4f", state.step, loss)

    def _enter_stage(self, stage: Stage) -> None:
        """Train on `stage`'s shards from here on; its checkpoints record their fingerprint."""
        if stage != self.stage:
            self.train_data = ShardedDataset(stage.path, "train")
            if self.run.dist.rank == 0:
                log.info(
                    "data stage %d from step %d: %s, at its sample %d",
                    stage.index + 1,
                    stage.from_step,
                    stage.path,
                    stage.position(self.state.consumed_samples, self.run.plan.global_batch_size),
                )
        self.stage = stage
        self.checkpointer.data_fingerprint = self.train_data.fingerprint

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's micro-batches from where the run stands in its data stage (the same samples whatever the
        world size)."""
        run = self.run
        loader = build_loader(
            self.train_data,
            seed=run.cfg.train.seed,
            micro_batch_size=run.plan.micro_batch_size,
            data_parallel_size=run.plan.data_parallel_size,  # a sequence-parallel group reads as one replica
            rank=run.replica,
            consumed_samples=self.stage.position(self.state.consumed_samples, run.plan.global_batch_size),
            num_workers=run.cfg.data.num_workers,
        )
        return iter(loader)

    def _step(
        self, batches: Iterator[dict[str, torch.Tensor]], lr: float, stop_requested: bool, offload: Any, first: bool
    ) -> tuple[float, bool, dict[str, float]]:
        """One optimizer step, the state moved past it; (the mean loss over ranks, whether any rank was asked to
        stop, the step's timings)."""
        run, state = self.run, self.state
        rank, device = run.dist.rank, run.dist.device
        poison = rank == 0 and faults.armed("NONFINITE_AT_STEP", state.step + 1)
        timings: dict[str, float] = {}
        t0, c0 = time.perf_counter(), time.process_time()
        step_loss = train_step(
            self.engine,
            batches,
            run.plan.grad_accum,
            lr,
            device,
            poison=poison,
            progress=self.watchdog.beat,
            timings=timings,
            around=offload,
            sequence=run.sequence,
            backward_scale=self.backward_scale,
        )
        if offload is not None and first and rank == 0:
            say_activation_offload(offload.stats, device)
        state.step += 1
        state.consumed_samples += run.plan.global_batch_size
        loss, stopping = self._agree(step_loss, stop_requested)
        timings["step_s"] = time.perf_counter() - t0  # _agree waited for the step's last kernel
        if device.type == "cpu":  # this rank's CPU seconds (its threads): a second job on the node does not add to it
            timings["step_cpu_s"] = time.process_time() - c0
        return loss, stopping, timings

    def _stopped(self) -> None:
        self.stopped_early = self.state.step < self.max_steps
        if self.run.dist.rank == 0:
            log.info(
                "stopped by signal at step %d of %d; checkpoint saved, resume with the same command",
                self.state.step,
                self.max_steps,
            )

    def _agree(self, step_loss: torch.Tensor, stop_requested: bool) -> tuple[float, bool]:
        """The one host sync of a step: the mean loss over the data-parallel replicas (a sequence-parallel group's
        ranks each hold a share of their replica's loss, which the sum adds up), and whether any rank was asked to
        stop."""
        import deepspeed.comm as dist

        device = self.run.dist.device
        flag = torch.stack([step_loss, torch.tensor(float(stop_requested), dtype=torch.float64, device=device)])
        dist.all_reduce(flag)
        return flag[0].item() / self.run.plan.data_parallel_size, flag[1].item() > 0

    def close(self) -> None:
        self.watchdog.stop()
        self.sink.close()
        self.lock.release()
