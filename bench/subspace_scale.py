#!/usr/bin/env python
"""The subspace stage at LLaVA scale: d = 4096, 10^6 tokens streamed through the stage's own code.

Batches of synthetic token embeddings (a decaying spectrum, the backbone's dtype, made on the device one
batch at a time, as the frozen embedding layer would give them) go through ``mcit.run.subspace_stage.stream_statistics``
with a minimal statistics holder: per batch ``token_covariance`` on the device, the float64 sum on the
CPU, the all-reduce, ``energy_basis`` (eigh of the d x d covariance) on rank 0, the broadcast and the
per-rank digest check -- exactly the stage's path. It prints the time of the streaming part and of the
decomposition, tokens/s, the peak GPU memory above the model-free baseline, and the peak host memory.

    python bench/subspace_scale.py                          # d 4096, 10^6 tokens, batches of 16 x 640 tokens
    python bench/subspace_scale.py --dim 256 --tokens 20000 # a quick look on a CPU
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _Embeds:
    """One batch of token embeddings, generated on ``device`` when the stage moves it there."""

    def __init__(self, n: int, tokens: int, mix: Any, seed: int, dtype: Any) -> None:
        self.n, self.tokens, self.mix, self.seed, self.dtype = n, tokens, mix, seed, dtype

    def to(self, device: Any) -> tuple[Any, Any]:
        import torch

        g = torch.Generator(device=device).manual_seed(self.seed)
        x = torch.randn(self.n, self.tokens, self.mix.shape[0], generator=g, device=device, dtype=self.dtype)
        return x @ self.mix.T, torch.ones(self.n, self.tokens, device=device)


class _Holder:
    """What a method gives the stage: ``statistics`` per batch, ``finalize_statistics`` on rank 0, a state."""

    def __init__(self, eps: float) -> None:
        import torch

        self.eps, self.basis, self.decompose_s = eps, torch.zeros(0, 0), 0.0

    def statistics(self, batch: tuple[Any, Any]) -> dict[str, Any]:
        from mcit.core.subspace import token_covariance

        cov, n = token_covariance(*batch)
        return {"cov": cov, "n": n}

    def finalize_statistics(self, sums: dict[str, Any], task: int) -> None:
        from mcit.core.subspace import energy_basis

        t0 = time.perf_counter()
        self.basis = energy_basis(sums["cov"] / sums["n"], self.eps).float()
        self.decompose_s = time.perf_counter() - t0

    def state_dict(self) -> dict[str, Any]:
        return {"basis": self.basis}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.basis = state["basis"]

    def subspace_report(self) -> dict[str, Any]:
        return {"dims": int(self.basis.shape[1])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=1_000_000, help="tokens streamed in all")
    ap.add_argument("--batch", type=int, default=16, help="samples per batch")
    ap.add_argument("--seq", type=int, default=640, help="tokens per sample (LLaVA-1.5: 576 image + text)")
    ap.add_argument("--eps", type=float, default=0.99)
    args = ap.parse_args()

    import torch

    from mcit.core import distributed as dist
    from mcit.run.subspace_stage import stream_statistics

    dist.init()
    device = dist.device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    mix = (torch.randn(args.dim, args.dim, generator=g) * torch.logspace(0, -2, args.dim)).to(device, dtype)
    per = args.batch * args.seq
    n_batches = -(-args.tokens // per)
    batches = [_Embeds(args.batch, args.seq, mix, i, dtype) for i in range(n_batches)]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    holder = _Holder(args.eps)
    t0 = time.perf_counter()
    report = stream_statistics(holder, batches, 0)
    total = time.perf_counter() - t0
    tokens = n_batches * per
    print(f"subspace stage: d {args.dim}, {tokens:,} tokens in {n_batches} batches of {args.batch} x {args.seq}, "
          f"{dtype} embeddings on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    streaming = total - holder.decompose_s
    print(f"total {total:.1f} s = streaming {streaming:.1f} s ({tokens / streaming:,.0f} "
          f"tokens/s) + energy_basis {holder.decompose_s:.1f} s; basis {report['dims']} of {args.dim} dims at eps "
          f"{args.eps}")
    if device.type == "cuda":
        print(f"peak GPU memory above the start: {(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB "
              f"(one batch of embeddings: {per * args.dim * mix.element_size() / 2**30:.2f} GiB)")
    print(f"peak host memory (ru_maxrss): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    dist.shutdown()
    return 0


if __name__ == "__main__":
    from mcit.core.distributed import exit_process

    exit_process(main())
