#!/usr/bin/env python
"""The pipeline's whole train stage (loader + engine) against a bare loop over pre-decoded tensors, in one run.

Same model (the config's frozen backbone + method, built fresh from one seed for every pass), same batches
(the stage's own samples, order, padding and augmentation draws: the bare loop's batches are collated once,
before timing, by the same ``train_epochs`` with the stage's seeds) and the same number of optimizer steps.

* stage: ``mcit.run.engine.TaskTrainer.train`` on task 0 as the pipeline runs it: shards read, decoded, augmented
  (``data.train_transform``) and collated by ``data.num_workers`` loader workers (or in the training process
  with 0), DeepSpeed ZeRO-2 with the non-finite guard, logging. Step checkpoints are off unless
  ``--checkpoint-every`` is given (the bare loop writes none).
* bare: a plain loop over the pre-collated tensors with torch's Adam.

Time is taken from the end of the first optimizer step to the end of the last (``on_optimizer_step``), so
DeepSpeed's start-up is not counted but everything between steps is: epoch starts, worker start-up, waiting
for a batch. The passes alternate (stage with 0 workers, stage with N, bare) for ``--rounds`` rounds; the
headline is the median of the per-round paired ratios stage / bare for each worker count (target >= 0.9 with
workers).

    python bench/train_stage_throughput.py [--config configs/digits_l2p.yaml] [--workers 0 2] [--epochs 5]
        [--rounds 3] [--transform l2p]
    python bench/train_stage_throughput.py --vit-b16 --workers 0 4 --epochs 20 train.batch_size=64   # GPU size
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "digits_l2p.yaml"))
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="data.num_workers values to time")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--transform", default=None, help="data.train_transform and eval_transform (default: the config's)")
    ap.add_argument("--checkpoint-every", type=int, default=None, help="step checkpoints in the stage (default off)")
    ap.add_argument("--vit-b16", action="store_true",
                    help="a randomly initialised ViT-B/16 (224 px) instead of the tiny pre-trained ViT: the images "
                         "are decoded and resized to 224 px by the loader, as a real-size run does")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args()
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    os.chdir(ROOT)

    from bench.host import bench_host
    from mcit.core import distributed as dist
    from mcit.data.loader import Epoch, micro_steps_per_epoch, train_epochs
    from mcit.run.engine import TaskTrainer, data_seed, on_optimizer_step

    overrides = [f"train.epochs={args.epochs}", "train.grad_accum=1", "train.progress=false",
                 f"train.checkpoint_every={args.checkpoint_every or 10**9}", *args.overrides]
    if args.transform:
        # both presets: a run has one normalisation
        overrides += [f"data.train_transform={args.transform}", f"data.eval_transform={args.transform}"]
    with bench_host(args.config, overrides, random_vit_b16=args.vit_b16) as (plan, host):
        cfg, backbone, device = plan.cfg, host.backbone, dist.device()
        split, task, B = plan.train[0], 0, cfg.train.batch_size
        collate = host.collate(task, train=True)  # the run's pipeline, augmentation and normalisation
        steps = micro_steps_per_epoch(split, 1, B, 1, cfg.data.split)

        # the stage's batches, collated once (in this process) with its seeds: what the bare loop trains on
        epochs = [Epoch(0, data_seed(cfg.seed, task, e, 0), data_seed(cfg.seed + 13, task, e, 0))
                  for e in range(cfg.train.epochs)]
        batches = [b.to(device) for b in train_epochs(split, epochs, rank=0, world=1, batch_size=B, num_steps=steps,
                                                      policy=cfg.data.split, shuffle_buffer=cfg.data.shuffle_buffer,
                                                      collate=collate)]

        def fresh():
            """A freshly built method at the start of task 0's (first) train stage, as the pipeline has it."""
            host.build()
            return host.begin_train(task, host.method_cls.phases[0])

        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        marks: list[float] = []

        @on_optimizer_step
        def _mark(_task: int, _step: int, _engine) -> None:
            sync()
            marks.append(time.perf_counter())

        # GPU utilisation (NVML, via torch.cuda.utilization) sampled every 50 ms by a thread; each pass reports the
        # mean over its timed window only (first to last optimizer step)
        samples: list[tuple[float, int]] = []
        util: dict[str, list[float]] = {}
        stop_sampling = threading.Event()

        def _sample() -> None:
            while not stop_sampling.wait(0.05):
                samples.append((time.perf_counter(), torch.cuda.utilization()))

        if device.type == "cuda":
            threading.Thread(target=_sample, daemon=True).start()

        def busy(kind: str, t0: float, t1: float) -> None:
            got = [u for t, u in samples if t0 <= t <= t1]
            if got:
                util.setdefault(kind, []).append(sum(got) / len(got))

        def stage(workers: int) -> float:
            marks.clear()
            loader = dataclasses.replace(plan.loader, num_workers=workers)
            with tempfile.TemporaryDirectory() as step_dir:
                TaskTrainer(cfg, loader=loader).train(fresh(), task, split, collate, Path(step_dir))
            assert len(marks) == len(batches), (len(marks), len(batches))
            busy(f"stage, {workers} workers", marks[0], marks[-1])
            return (len(marks) - 1) / (marks[-1] - marks[0])

        def bare() -> float:
            m = fresh().train()
            groups = [{"params": [p for p in g["params"] if p.requires_grad],
                       "lr": cfg.train.lr * g.get("lr_scale", 1.0)} for g in m.param_groups()]
            opt = torch.optim.Adam([g for g in groups if g["params"]], lr=cfg.train.lr)
            times = []
            for b in batches:
                terms = m(b)
                valid = b.valid.to(terms.per_sample.dtype)
                loss = (terms.per_sample * valid).sum() / valid.sum()
                if terms.regularizer is not None:
                    loss = loss + terms.regularizer
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sync()
                times.append(time.perf_counter())
            busy("bare loop", times[0], times[-1])
            return (len(times) - 1) / (times[-1] - times[0])

        rates: dict[str, list[float]] = {f"stage, {w} workers": [] for w in args.workers}
        rates["bare loop"] = []
        stage(args.workers[0])  # warm-up: first DeepSpeed start, first worker start
        for r in range(args.rounds):
            for w in args.workers:
                rates[f"stage, {w} workers"].append(stage(w))
            rates["bare loop"].append(bare())
            print(f"round {r + 1}: " + "   ".join(f"{k} {v[-1] * B:7.1f} samples/s" for k, v in rates.items()),
                  flush=True)
        print(f"model: frozen {cfg.backbone.kind} ({backbone.num_layers} layers, hidden {backbone.hidden_size}) + "
              f"{cfg.method.name}; task 0 of {Path(args.config).name}: {split.num_samples} samples, batch {B}, "
              f"{len(batches)} steps ({cfg.train.epochs} epochs); train_transform {cfg.data.train_transform}; "
              f"torch threads {torch.get_num_threads()}; CPU cores {os.cpu_count()}; "
              f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
        bare_rates = rates["bare loop"]
        print(f"bare loop over pre-decoded tensors: {statistics.median(bare_rates) * B:8.1f} samples/s (median)")
        for w in args.workers:
            got = rates[f"stage, {w} workers"]
            paired = statistics.median(s / b for s, b in zip(got, bare_rates))
            print(f"train stage, num_workers={w}: {statistics.median(got) * B:8.1f} samples/s (median); "
                  f"ratio stage / bare = {paired:.3f}  (median of the per-round paired ratios; target >= 0.9 with "
                  f"workers)")
        stop_sampling.set()
        for kind, u in util.items():
            print(f"GPU utilisation, {kind}: {statistics.median(u):.0f}% "
                  f"(median over rounds of the mean of 50 ms NVML samples)")
        return 0


if __name__ == "__main__":
    from mcit.core.distributed import exit_process

    exit_process(main())
