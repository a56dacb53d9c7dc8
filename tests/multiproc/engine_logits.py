"""Run under the deepspeed launcher: for each case, load a checkpoint into a real engine and save its logits on val
sample 0. One launch loads several runs' checkpoints, one engine after the other (each launch is 13 s of CPU here,
most of it imports): `engine_logits.py CASES`, CASES a JSON list of {"config": path, "tag": name, "out": path}."""

from __future__ import annotations

import gc
import json
import os
import sys

import torch


def main() -> int:
    [cases] = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    import deepspeed.comm as dist

    from pipeline.train.runtime.dist import init_distributed

    rank = init_distributed().rank
    for case in json.loads(cases):
        logits(case["config"], case["tag"], case["out"], rank)
        gc.collect()
    dist.barrier()
    return 0


def logits(config: str, tag: str, out: str, rank: int) -> None:
    from pipeline.data.loader import ShardedDataset
    from pipeline.train.engine import build_engine
    from pipeline.train.setup.config import load
    from pipeline.train.setup.prepare import prepare

    cfg = load(config)
    p = prepare(cfg, int(os.environ["WORLD_SIZE"]))
    cfg, ds, shape, manifest = p.cfg, p.ds, p.shape, p.manifest
    engine = build_engine(cfg, ds, p.layout, shape, manifest["tokenizer"], rank)
    engine.load_checkpoint(cfg.run_dir, tag=tag, load_optimizer_states=False)
    engine.eval()
    ids = torch.from_numpy(ShardedDataset(cfg.data.path, "val")[0][:-1].astype("int64"))[None]
    with torch.no_grad():
        got = engine(input_ids=ids).logits
    if rank == 0:
        torch.save({"input_ids": ids, "logits": got.float()}, out)
    engine.destroy()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
