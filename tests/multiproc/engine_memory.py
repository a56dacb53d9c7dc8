"""Run under the deepspeed launcher: for each case (a config and its --set overrides) build a real engine, take one
step, and report the bytes it holds per rank for parameters, gradients and optimizer states; rank 0 writes the
list as JSON. One launch measures several engines, one after the other (each launch is 13 s of CPU here, most of
it imports): `engine_memory.py CASES OUT.json`, CASES a JSON list of {"config": path, "sets": [...]}."""

from __future__ import annotations

import gc
import json
import os
import sys

import torch


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def main() -> int:
    cases, out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    import deepspeed.comm as dist

    from pipeline.train.runtime.dist import init_distributed

    rank = init_distributed().rank
    results = []
    for case in json.loads(cases):
        results.append(measure(case["config"], case.get("sets", []), rank))
        gc.collect()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    return 0


def measure(config: str, sets: list[str], rank: int) -> dict:
    import deepspeed.comm as dist

    from pipeline.data.loader import ShardedDataset, collate_samples
    from pipeline.train.engine import build_engine
    from pipeline.train.setup.config import load
    from pipeline.train.setup.prepare import prepare
    from pipeline.train.step import lm_loss

    cfg = load(config, sets)
    p = prepare(cfg, int(os.environ["WORLD_SIZE"]))
    cfg, ds, shape, manifest = p.cfg, p.ds, p.shape, p.manifest
    engine = build_engine(cfg, ds, p.layout, shape, manifest["tokenizer"], rank)
    stage = ds["zero_optimization"]["stage"]
    zero = engine.optimizer
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    data = ShardedDataset(cfg.data.path, "train")
    batch = collate_samples(data, [rank])
    loss, _, _ = lm_loss(engine(input_ids=batch["input_ids"]).logits, batch["labels"])
    engine.backward(loss)
    if stage == 3:
        fp32 = list(zero.fp32_partitioned_groups_flat)
        grads16 = (
            [g for g in zero.averaged_gradients.values() for g in (g if isinstance(g, list) else [g])]
            if isinstance(zero.averaged_gradients, dict)
            else []
        )
    else:
        fp32 = list(zero.single_partition_of_fp32_groups)
        grads16 = (
            [g for group in zero.averaged_gradients.values() for g in group]
            if isinstance(zero.averaged_gradients, dict)
            else []
        )
    grads16_bytes = _bytes(grads16) or sum(t.numel() for t in fp32) * 2
    engine.step()
    states = [v for s in zero.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
    result = {
        "stage": stage,
        "world": dist.get_world_size(),
        "psi": shape.num_params(),
        "params": _bytes(params),
        # 16-bit gradient partition held after backward + the fp32 copy the optimizer step makes of it
        "grads": grads16_bytes + sum(t.numel() for t in fp32) * 4,
        "optimizer": _bytes(fp32) + _bytes(states),
    }
    if hasattr(zero, "selective_optimizer"):  # ZenFlow: the top-k columns' Adam moments, kept on the GPU
        selective = zero.selective_optimizer.state.values()
        result["zenflow_selective"] = _bytes(
            v for s in selective for v in s.values() if torch.is_tensor(v) and v.numel() > 1
        )
    engine.destroy()
    return result


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
