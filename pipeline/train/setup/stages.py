"""Data stages: a run may change its training shards at named steps (`data.stages: {900: data/curated-4096}`:
after update 900 the run trains on those shards, typically the decay's curated mix). The first stage is
`data.path`, from step 0. Within a stage the sample order is the loader's (pipeline.data.loader) from the stage's
first update, so it is the same for any world size and resumes at any sample inside either stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.data.manifest import ShardManifest, read_shard_manifest
from pipeline.errors import PipelineError


@dataclass(frozen=True, slots=True)
class Stage:
    index: int
    from_step: int
    """The stage trains updates from_step + 1 on (the 0-based update index from_step on)."""
    path: str

    def position(self, consumed_samples: int, global_batch_size: int) -> int:
        """The samples of this stage already trained, from the run's count (its global batch is fixed)."""
        return consumed_samples - self.from_step * global_batch_size


def stages(data: Any) -> list[Stage]:
    """The run's stages in order: `data.path` from step 0, then `data.stages` by step."""
    extra = sorted((int(step), str(path)) for step, path in (data.stages or {}).items())
    return [Stage(0, 0, data.path)] + [Stage(i + 1, step, path) for i, (step, path) in enumerate(extra)]


def stage_at(data: Any, update: int) -> Stage:
    """The stage that trains 0-based update `update`."""
    return [s for s in stages(data) if s.from_step <= update][-1]


def stage_of_checkpoint(data: Any, step: int) -> Stage:
    """The stage a checkpoint taken after `step` updates trained last (whose fingerprint its marker records)."""
    return stage_at(data, max(step - 1, 0))


def stage_problems(data: Any, first: ShardManifest, max_steps: int) -> list[str]:
    """Why `data.stages` cannot run (empty: it can): steps that are not positive integers inside the run, shard
    folders that are missing, or of another seq_len or tokenizer than data.path's."""
    problems = []
    for raw_step, path in (data.stages or {}).items():
        try:
            step = int(raw_step)
        except (TypeError, ValueError):
            problems.append(f"data.stages {raw_step}: expected a step number, e.g. {{900: data/curated}}")
            continue
        if not 0 < step < max_steps:
            problems.append(
                f"data.stages {step}: expected a step between 1 and the run's {max_steps - 1} (the stage trains the "
                "updates after it)"
            )
        try:
            m = read_shard_manifest(str(path))
        except PipelineError as e:
            problems.append(f"data.stages {step}: {e}")
            continue
        if m["seq_len"] != first["seq_len"]:
            problems.append(f"data.stages {step}: {path} has seq_len {m['seq_len']}, data.path {first['seq_len']}")
        if m["tokenizer"]["sha256"] != first["tokenizer"]["sha256"]:
            problems.append(
                f"data.stages {step}: {path} was tokenized with {m['tokenizer']['path']}, data.path with "
                f"{first['tokenizer']['path']}: every stage needs the model's one tokenizer"
            )
    return problems


def fingerprint_at(data: Any, step: int) -> str:
    """The fingerprint of the shards a checkpoint after `step` updates trained last (from their manifest)."""
    return read_shard_manifest(stage_of_checkpoint(data, step).path)["fingerprint"]
