#!/usr/bin/env python
"""How much of a task's LoRA update reaches the next task through SEFE's official merge, against mcit's stack.

The official chain (jinpeng0528/SEFE 2f61efe, as MCITlib's copy): ``scripts/merge_lora_weights.py`` ->
``llava/model/builder.py`` loads the model with ``torch_dtype=torch.float16``, ``merge_and_unload`` adds the
pair's ``B A * alpha / r`` in float16 and the merged model is saved in float16; the next task's ``train.py``
loads it with ``--bf16 True`` (bfloat16 weights). mcit keeps the pair unmerged: the frozen base in training
precision plus the exact update in the LoRA path (``mcit/methods/sefe.py``).

On a Vicuna-7B-sized projection (4096 x 4096, float16, std 0.02) and a rank-16 update whose entries' std is
``ratio`` times the weight's, this prints what the float16 checkpoint holds of the update and what the next
task's bfloat16 weights hold of it (their difference to the bfloat16 base): cosine to the exact update, relative
error, and the fraction of entries whose update is lost to rounding. Deterministic (seed 0), CPU, seconds.

    python bench/sefe_merge_precision.py [--ratios 0.001 0.003 0.01 0.03 0.1] [--size 4096] [--rank 16]
"""

from __future__ import annotations

import argparse


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.001, 0.003, 0.01, 0.03, 0.1])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(a.size, a.size, generator=g) * 0.02).half()  # the checkpoint's float16 weight
    base = w.to(torch.bfloat16).double()  # what a bfloat16 run starts from (mcit's frozen base as well)

    def cos(x: torch.Tensor, y: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0))

    def err(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x - y).norm() / y.norm())

    print(f"{'ratio':>7} {'fp16 cos':>9} {'fp16 err':>9} {'bf16 cos':>9} {'bf16 err':>9} {'bf16 lost':>9}")
    for ratio in a.ratios:
        delta = torch.randn(a.size, a.rank, generator=g) @ torch.randn(a.rank, a.size, generator=g)
        delta = (delta * (ratio * 0.02 / delta.std())).double()
        merged = (w + delta.half()).half()  # merge_and_unload in float16, saved in float16
        kept16 = merged.double() - w.double()
        kept_bf16 = merged.to(torch.bfloat16).double() - base  # the next task's bfloat16 weights minus its base
        lost = float(((kept_bf16 == 0) & (delta != 0)).double().mean())
        print(f"{ratio:>7g} {cos(kept16, delta):>9.4f} {err(kept16, delta):>9.4f} {cos(kept_bf16, delta):>9.4f} "
              f"{err(kept_bf16, delta):>9.4f} {lost:>9.4f}")
    print("mcit's stack adds the exact update in the LoRA path: cosine 1, error 0 up to the activations' rounding")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
