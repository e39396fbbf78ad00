#!/usr/bin/env python
"""Training throughput of the pipeline's engine vs a bare PyTorch loop, measured in the same run.

Same model (the demo's frozen tiny ViT + L2P prompts/keys/head), same batches (task0 of the embedded
digits benchmark, decoded once into memory), same optimizer (Adam). The engine path is exactly what
the train stage runs per step: ``mcit.run.engine.setup_engine`` + ``mcit.run.engine.train_step`` (DeepSpeed
ZeRO-2, valid-weighted loss, and the non-finite guard: one all-reduce of the loss and a host sync per
micro-batch). The two paths alternate every few steps to share the machine's noise; the headline is
the median of the per-round paired ratios (target >= 0.95); medians and best rounds are printed too.

    python bench/engine_throughput.py [--batch 64] [--steps 60] [--rounds 5] [--ds-config deepspeed_configs/zero2.json]
    python bench/engine_throughput.py --vit-b16      # ViT-B/16 at 224 px (random weights): the size the papers use

On a CUDA machine both paths run on the GPU (fp32) and the printout adds GPU memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "digits_l2p.yaml"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=5, help="steps per path before switching to the other")
    ap.add_argument("--ds-config", default="deepspeed_configs/zero2.json")
    ap.add_argument("--vit-b16", action="store_true",
                    help="a randomly initialised ViT-B/16 (224 px, 12 x 768) instead of the tiny pre-trained ViT")
    args = ap.parse_args()
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    os.chdir(ROOT)

    from bench.host import bench_host
    from mcit.core import distributed as dist
    from mcit.data.loader import eval_batches
    from mcit.data.types import Batch
    from mcit.run.engine import finite_loss_guard, setup_engine, train_step

    overrides = [f"train.batch_size={args.batch}", f"train.deepspeed_config={args.ds_config}", "train.grad_accum=1"]
    with bench_host(args.config, overrides, random_vit_b16=args.vit_b16) as (plan, host):
        cfg, device = plan.cfg, dist.device()
        # task 0's training samples as the eval stage collates them (no augmentation), decoded once into memory
        data = list(eval_batches(plan.train[0], rank=0, world=1, batch_size=args.batch, policy="sample",
                                 collate=host.collate(0, train=True, augment=False)))
        data = [b.to(device) for b in data if len(b) == args.batch]
        batches = [data[i % len(data)] for i in range(args.steps)]

        def fresh():
            """A freshly built method at the start of task 0's (first) train stage, as the pipeline has it."""
            host.build()
            return host.begin_train(0, host.method_cls.phases[0])

        # Both paths stay alive and alternate every ``--chunk`` steps, so slow phases of a noisy machine
        # hit both alike; each round reports the throughput of its own chunks.
        bare_m = fresh().train()
        opt = torch.optim.Adam(bare_m.trainable_parameters(), lr=cfg.train.lr)
        eng, _ = setup_engine(cfg, fresh(), 1)
        eng.train()
        scale = 1.0 / args.batch

        def bare_step(b: Batch) -> None:
            loss = bare_m(b).per_sample.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        def engine_step(b: Batch) -> None:  # as the train stage runs it: with the non-finite guard
            train_step(eng, b, scale, lambda loss: finite_loss_guard(loss, 0, 0))

        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

        for b in batches[:5]:  # warm-up
            bare_step(b)
            engine_step(b)
        bare_rates, eng_rates = [], []
        for r in range(args.rounds):
            t_bare = t_eng = 0.0
            for c in range(0, len(batches), args.chunk):
                chunk = batches[c:c + args.chunk]
                t0 = time.perf_counter()
                for b in chunk:
                    bare_step(b)
                sync()
                t1 = time.perf_counter()
                for b in chunk:
                    engine_step(b)
                sync()
                t2 = time.perf_counter()
                t_bare += t1 - t0
                t_eng += t2 - t1
            n = len(batches) * args.batch
            bare_rates.append(n / t_bare)
            eng_rates.append(n / t_eng)
            print(f"round {r + 1}: bare {bare_rates[-1]:8.1f} samples/s   engine {eng_rates[-1]:8.1f} samples/s",
                  flush=True)
        eng.destroy()
        b, e = statistics.median(bare_rates), statistics.median(eng_rates)
        bb, eb = max(bare_rates), max(eng_rates)
        print(f"model: frozen ViT ({host.backbone.num_layers} layers, hidden {host.backbone.hidden_size}) + "
              f"{cfg.method.name}; "
              f"batch {args.batch}; {args.steps} steps x {args.rounds} rounds; threads {torch.get_num_threads()}; "
              f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
        if device.type == "cuda":
            print(f"peak GPU memory   : {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        print(f"bare PyTorch loop : {b:8.1f} samples/s (median)")
        print(f"mcit engine ({Path(args.ds_config).stem}): {e:8.1f} samples/s (median)")
        print(f"best of rounds    : bare {bb:.1f}, engine {eb:.1f} samples/s, ratio {eb / bb:.3f}")
        paired = statistics.median(er / br for er, br in zip(eng_rates, bare_rates))
        print(f"ratio of medians  : {e / b:.3f}")
        print(f"ratio engine / bare = {paired:.3f}  (median of the per-round paired ratios; target >= 0.95)")
        return 0


if __name__ == "__main__":
    from mcit.core.distributed import exit_process

    exit_process(main())
