"""2-rank worker: three 'tasks' of each LoRA-family method (``lora``, ``olora``, ``moelora``), each task with a
rebuilt method and a new DeepSpeed engine, as the pipeline does; reports per method whether every new engine
starts from the state loaded into the method, whether each task trained, and whether the parameters the
method keeps frozen (O-LoRA's earlier tasks' pairs) stayed bit-identical."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def run(method_name: str, params: dict, ds: str, backbone: str, shards: str) -> dict:
    from mcit.core import distributed as dist
    from mcit.core.config import validate_config
    from mcit.core.registry import METHODS
    from mcit.data.loader import train_batches
    from mcit.data.shards import open_split
    from mcit.data.types import TaskSequence
    from mcit.models.mllm import MLLMBackbone
    from mcit.run.engine import consolidated_state, setup_engine, train_step

    bb = MLLMBackbone.from_path(backbone)  # one backbone per method: each injects its own LoRA layers
    cfg = validate_config({"name": "l", "backbone": {"kind": "llava", "path": "unused"},
                           "data": {"tasks": ["colour"], "root": "."}, "method": {"name": method_name, **params},
                           "train": {"lr": 0.01, "batch_size": 4, "deepspeed_config": ds}})
    seq = TaskSequence.from_label_spaces(["a", "b", "c"], [[], [], []])
    state, trained, starts, frozen_kept = None, [], [], []
    for task, name in enumerate(["colour", "count", "position"]):
        torch.manual_seed(0)
        method = METHODS.get(method_name)(cfg.method.params(), bb, seq)
        if state is not None:
            method.load_state_dict(state)
        method.set_task(task)
        method.before_task(task)
        # what must not move: O-LoRA's pairs of the tasks before this one (named by the task, not by requires_grad)
        frozen = [n for n, _ in method.named_parameters() if any(n.endswith(f".task{i}") for i in range(task))]
        split = open_split(Path(shards) / name / "train")
        engine, stage = setup_engine(cfg, method, dist.world_size())
        before = consolidated_state(engine, stage)
        if state is not None:
            starts.append(all(torch.allclose(before[k], state[k]) for k in state))
        for batch in train_batches(split, rank=dist.rank(), world=dist.world_size(), batch_size=4, num_steps=2,
                                   skip_steps=0, seed=dist.rank(), policy="sample", shuffle_buffer=8,
                                   collate=bb.make_collate(split, 0, train=True)):
            train_step(engine, batch, 1.0 / 4)
        after = consolidated_state(engine, stage)
        trained.append(any(not torch.equal(after[k], before[k]) for k in after))
        frozen_kept.append(len(frozen) if all(torch.equal(after[k], before[k]) for k in frozen) else -1)
        state = after
        engine.destroy()
    return {"trained": trained, "starts_from_loaded": starts, "frozen_kept": frozen_kept}


def main(backbone: str, shards: str, out: str, zero2: str, zero3: str) -> None:
    from mcit.core import distributed as dist

    dist.init()
    res = {"lora": run("lora", {"r": 2}, zero2, backbone, shards),
           "olora": run("olora", {"r": 2, "lamda_2": 0.1}, zero3, backbone, shards),
           "moelora": run("moelora", {"r": 4, "experts": 2, "alpha": 8}, zero3, backbone, shards)}
    if dist.is_main():
        Path(out).write_text(json.dumps(res))
    dist.shutdown()


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
    from mcit.core.distributed import exit_process

    exit_process(0)
