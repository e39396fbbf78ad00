"""Multi-rank worker: run several configs' whole task sequences through the Pipeline in one process group
(one launch, several methods) and, after every optimizer step, compare the weights the next forward will
read with what the engine meant them to be: the previous step's weights plus the method's projection of
the optimizer's update (``Method.project_update``, recorded as the engine calls it). For a projection
that is idempotent (an orthogonal projector: Fwd-Prompt, PGP) it also measures how far the weights have
moved outside the projector's range since the task's first step.

Run by tests/launch/test_zero_projection.py as ``deepspeed worker OUT.json CONFIG...``; rank 0 writes
``{config name: {"read_vs_projected" (max abs), "update" (max abs), "outside_subspace", "worst", "checked",
"moved"}}``.
"""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import torch


def forward_weights(engine) -> dict[str, torch.Tensor]:
    """The trainable tensors exactly as the next forward reads them: under ZeRO-3 a parameter kept gathered
    (``stage3_param_persistence_threshold``) is read from ``p.data`` as it is, a partitioned one is gathered
    from the ranks' partitions; under ZeRO-0/1/2 ``p.data`` is the working copy."""
    import deepspeed

    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        if hasattr(p, "ds_tensor") and p.data.numel() != p.ds_numel:
            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.data.detach().clone().float()
        else:
            out[name] = p.data.detach().clone().float()
    return out


_INNER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # method -> its own project_update


def _recording(method, kept: dict[str, torch.Tensor]) -> None:
    """Record, per parameter, the projected update the engine applies at each step."""
    if method in _INNER:
        return
    inner = method.project_update

    def project_update(name: str, delta: torch.Tensor) -> torch.Tensor | None:
        out = inner(name, delta)
        if out is not None:
            kept[name] = out.detach().clone().float()
        return out

    method.project_update = project_update
    _INNER[method] = inner


def main(out: str, *configs: str) -> None:
    from mcit.core import distributed as dist
    from mcit.core.config import load_config
    from mcit.run.engine import on_optimizer_step
    from mcit.run.pipeline import Pipeline
    from mcit.run.preflight import preflight

    dist.init()
    report: dict[str, dict] = {}
    current: dict = {}

    @on_optimizer_step
    def check(task: int, gstep: int, engine) -> None:
        method, r, kept = engine.module, current["stats"], current["kept"]
        now = forward_weights(engine)
        if gstep == 1 or "prev" not in current:  # the first step checked is the next one
            current["first"], current["prev"] = now, now
            kept.clear()
            _recording(method, kept)
            return
        for name, update in kept.items():
            if not bool(update.ne(0).any()):
                continue
            # float32 absolute error of (new - prev) is ~1e-7 x the weights' size, so compare absolute values
            gap = float((now[name] - current["prev"][name] - update).abs().max())
            if gap >= r["read_vs_projected"]:
                r["read_vs_projected"], r["worst"] = gap, f"{name} (task {task}, step {gstep})"
            r["update"] = max(r["update"], float(update.abs().max()))
            r["checked"] += 1
            d = now[name] - current["first"][name]
            r["moved"] = max(r["moved"], float(d.norm()))
            twice = _INNER[method](name, d)
            if twice is not None and float(d.norm()) > 0:
                r["outside_subspace"] = max(r["outside_subspace"], float((twice - d).norm()) / float(d.norm()))
        kept.clear()
        current["prev"] = now

    for path in configs:
        cfg = load_config(path)
        current.clear()
        current.update(stats={"read_vs_projected": 0.0, "update": 0.0, "outside_subspace": 0.0, "worst": None,
                              "checked": 0, "moved": 0.0}, kept={})
        plan = preflight(cfg)
        dist.barrier()  # as the entry point's init does: every rank's pre-flight ends before any rank runs
        Pipeline(plan).run()
        report[cfg.name] = dict(current["stats"])
    if dist.is_main():
        Path(out).write_text(json.dumps(report))
    dist.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
    from mcit.core.distributed import exit_process

    exit_process(0)
