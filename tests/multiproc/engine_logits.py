"""Run under the deepspeed launcher: load a checkpoint into a real engine and save its logits on val sample 0."""

from __future__ import annotations

import os
import sys

import torch


def main() -> int:
    config, tag, out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    import deepspeed.comm as dist

    from pipeline.data.loader import ShardedDataset
    from pipeline.train.engine import build_engine
    from pipeline.train.runtime.dist import init_distributed
    from pipeline.train.setup.config import load
    from pipeline.train.setup.prepare import prepare

    cfg = load(config)
    p = prepare(cfg, int(os.environ["WORLD_SIZE"]))
    cfg, ds, shape, manifest = p.cfg, p.ds, p.shape, p.manifest
    env = init_distributed()
    engine = build_engine(cfg, ds, shape, manifest["tokenizer"], env.rank)
    engine.load_checkpoint(cfg.run_dir, tag=tag, load_optimizer_states=False)
    engine.eval()
    ids = torch.from_numpy(ShardedDataset(cfg.data.path, "val")[0][:-1].astype("int64"))[None]
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    if dist.get_rank() == 0:
        torch.save({"input_ids": ids, "logits": logits.float()}, out)
    dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
