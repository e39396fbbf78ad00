"""Peak memory of the subspace stage: streaming covariance vs concatenating all embeddings + one SVD.

Each measurement runs in a fresh subprocess and reports its peak resident memory above the level
reached after imports and the random mixing matrix (ru_maxrss delta). Embeddings are generated batch
by batch (synthetic tokens with a decaying spectrum, d and tokens per sample as in a small MLLM), so
the streaming path never holds more than one batch. It prints both ratios the issue asks for:

* stream(10x samples) / stream(1x)  -> about 1 (memory does not grow with the number of samples)
* concat(10x) / concat(1x)          -> about 10
and the concat / stream ratio at 10x, plus a check that both paths pick the same subspace.

    python bench/subspace_memory.py [--dim 512] [--tokens 32] [--samples 1000] [--batch 50]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _batches(dim: int, tokens: int, samples: int, batch: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) * torch.logspace(0, -2, dim)
    for start in range(0, samples, batch):
        n = min(batch, samples - start)
        x = torch.randn(n, tokens, dim, generator=g) @ mix.T
        yield x, torch.ones(n, tokens)


def worker(mode: str, dim: int, tokens: int, samples: int, batch: int, eps: float) -> dict:
    import torch

    from mcit.core.subspace import energy_basis, token_covariance

    torch.set_num_threads(1)  # one thread, one malloc arena (see main): a steadier peak-RSS reading
    torch.zeros(1 << 16) @ torch.zeros(1 << 16)  # warm the allocator before the baseline reading
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if mode == "stream":
        cov = torch.zeros(dim, dim, dtype=torch.float64)
        for x, m in _batches(dim, tokens, samples, batch):
            c, _ = token_covariance(x, m)
            cov += c
        basis = energy_basis(cov, eps)
    else:
        rows = torch.cat([x.reshape(-1, dim) for x, _ in _batches(dim, tokens, samples, batch)])
        _, s, vh = torch.linalg.svd(rows, full_matrices=False)
        energy = torch.cumsum(s.double() ** 2, 0) / (s.double() ** 2).sum()
        k = int((energy < eps).sum()) + 1
        basis = vh[:k].T.double()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "samples": samples, "peak_mb": (peak - base) / 1024, "seconds": seconds,
            "rank": basis.shape[1], "projector": (basis @ basis.T).flatten()[:: max(1, dim)].tolist()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--eps", type=float, default=0.95)
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "SAMPLES"))
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.dim, args.tokens, int(args.worker[1]), args.batch, args.eps)))
        return 0
    res = {}
    for mode in ("stream", "concat"):
        for mult in (1, 10):
            n = args.samples * mult
            out = subprocess.run([sys.executable, __file__, "--dim", str(args.dim), "--tokens", str(args.tokens),
                                  "--batch", str(args.batch), "--eps", str(args.eps), "--worker", mode, str(n)],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"})
            r = json.loads(out.stdout.strip().splitlines()[-1])
            res[(mode, mult)] = r
            print(f"{mode:6s} {n:7d} samples ({n * args.tokens} tokens x d={args.dim}): peak +{r['peak_mb']:8.1f} MB, "
                  f"{r['seconds']:6.2f} s, rank {r['rank']}")
    s1, s10 = res[("stream", 1)]["peak_mb"], res[("stream", 10)]["peak_mb"]
    c1, c10 = res[("concat", 1)]["peak_mb"], res[("concat", 10)]["peak_mb"]
    same = res[("stream", 10)]["rank"] == res[("concat", 10)]["rank"]
    diag = max(abs(a - b) for a, b in zip(res[("stream", 10)]["projector"], res[("concat", 10)]["projector"]))
    print(f"stream peak ratio 10x/1x: {s10 / max(s1, 1e-9):.2f}")
    print(f"concat+SVD peak ratio 10x/1x: {c10 / max(c1, 1e-9):.2f}")
    print(f"concat+SVD / stream peak at 10x: {c10 / max(s10, 1e-9):.1f}")
    print(f"same subspace: rank equal {same}, max |diag(P_stream - P_svd)| = {diag:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
