"""2-rank worker: train Fwd-Prompt a few steps under DeepSpeed with a fixed old-task basis and report
how much of the applied prompt update leaks into the protected subspace (run by tests/launch/test_mcit_pipeline.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main(backbone: str, shards: str, ds_config: str, project: str, out: str) -> None:
    from mcit import distributed as dist
    from mcit.config import validate_config
    from mcit.data.loader import train_batches
    from mcit.data.shards import open_split
    from mcit.engine import consolidated_state, full_fp32, setup_engine, train_step
    from mcit.data.types import TaskSequence
    from mcit.models.mllm import MLLMBackbone
    from mcit.registry import METHODS
    from mcit.subspace import project_out

    dist.init()
    cfg = validate_config({"name": "proj", "backbone": {"kind": "llava", "path": backbone},
                           "data": {"tasks": ["colour"], "root": shards},
                           "method": {"name": "fwd_prompt", "pool_size": 4, "top_n": 2, "prompt_length": 2,
                                      "combine": "residual", "project": project == "1"},
                           "train": {"lr": 0.05, "optimizer": "adam", "batch_size": 4, "deepspeed_config": ds_config}})
    bb = MLLMBackbone.from_path(backbone)
    seq = TaskSequence.from_label_spaces(["colour"], [[]])
    torch.manual_seed(0)
    method = METHODS.get("fwd_prompt")(cfg.method.params(), bb, seq)
    d = bb.hidden_size
    g = torch.Generator().manual_seed(3)
    basis, _ = torch.linalg.qr(torch.randn(d, 16, generator=g, dtype=torch.float64))
    method.task_basis[:, :16] = basis
    method.task_rank.fill_(16)
    p0 = method.prompts.detach().clone().float()
    split = open_split(Path(shards) / "colour" / "train")
    engine, stage = setup_engine(cfg, method, dist.world_size())
    batches = train_batches(split, rank=dist.rank(), world=dist.world_size(), batch_size=4, num_steps=4,
                            skip_steps=0, seed=dist.rank(), policy="sample", shuffle_buffer=16,
                            collate=bb.make_collate(split, 0, train=True))
    for batch in batches:
        train_step(engine, batch, 1.0 / 4)
    state = consolidated_state(engine, stage)  # fp32 master values, gathered
    delta = state["prompts"] - p0
    leak = float((delta - project_out(delta.double(), basis).float()).norm() / delta.norm())
    # The copy the next forward reads must be the projected master value too.
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([engine.module.prompts]):
            working = engine.module.prompts.detach().clone().float()
    else:
        working = engine.module.prompts.detach().clone().float()
    gap = float((working - full_fp32(engine.module.prompts) if stage != 3 else working - state["prompts"]).abs().max())
    if dist.is_main():
        Path(out).write_text(json.dumps({"leak": leak, "working_vs_master": gap, "update_norm": float(delta.norm()),
                                         "stage": stage, "world": dist.world_size()}))
    engine.destroy()
    dist.shutdown()


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
