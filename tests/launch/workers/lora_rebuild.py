"""2-rank worker: three 'tasks' of LoRA, each with a rebuilt method and a new ZeRO-2 engine, as the
pipeline does; reports whether every new engine starts from the state loaded into the method."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main(backbone: str, shards: str, out: str) -> None:
    from mcit import distributed as dist
    from mcit.config import validate_config
    from mcit.data.loader import train_batches
    from mcit.data.shards import open_split
    from mcit.engine import consolidated_state, setup_engine, train_step
    from mcit.data.types import TaskSequence
    from mcit.models.mllm import MLLMBackbone
    from mcit.registry import METHODS

    dist.init()
    bb = MLLMBackbone.from_path(backbone)
    cfg = validate_config({"name": "l", "backbone": {"kind": "llava", "path": "unused"},
                           "data": {"tasks": ["colour"], "root": "."}, "method": {"name": "lora", "r": 2},
                           "train": {"lr": 0.01, "batch_size": 4, "deepspeed_config": "deepspeed_configs/zero2.json"}})
    seq = TaskSequence.from_label_spaces(["a", "b", "c"], [[], [], []])
    state, trained, starts = None, [], []
    for name in ["colour", "count", "position"]:
        torch.manual_seed(0)
        method = METHODS.get("lora")(cfg.method.params(), bb, seq)
        if state is not None:
            method.load_state_dict(state)
        split = open_split(Path(shards) / name / "train")
        engine, stage = setup_engine(cfg, method, dist.world_size())
        before = consolidated_state(engine, stage)
        if state is not None:
            starts.append(all(torch.allclose(before[k], state[k]) for k in state))
        for batch in train_batches(split, rank=dist.rank(), world=dist.world_size(), batch_size=4, num_steps=2,
                                   skip_steps=0, seed=dist.rank(), policy="sample", shuffle_buffer=8,
                                   collate=bb.make_collate(split, 0, train=True)):
            train_step(engine, batch, 1.0 / 4)
        state = consolidated_state(engine, stage)
        trained.append(any(not torch.equal(state[k], before[k]) for k in state))
        engine.destroy()
    if dist.is_main():
        Path(out).write_text(json.dumps({"trained": trained, "starts_from_loaded": starts}))
    dist.shutdown()


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
