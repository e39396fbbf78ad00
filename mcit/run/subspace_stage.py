"""The subspace stage's protocol: stream on every rank, all-reduce, finalise on rank 0, broadcast.

Every rank sums the method's per-batch statistics (``X^T X`` of the valid tokens, d x d float64; see
``mcit/core/subspace.py``); the sums are all-reduced, rank 0 decomposes the d x d matrices once
(``finalize_statistics``) and broadcasts the method state, and every rank checks it holds the same bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

import torch

from mcit.core import distributed as dist


def stream_statistics(method: Any, batches: Iterable[Any], task: int) -> dict[str, Any] | None:
    """Run the subspace stage of ``task`` (-1: the reference set) over this rank's ``batches``.

    Every rank sums ``method.statistics`` over its batches (float64 on the CPU; ``cat:`` keys are
    concatenated instead); the sums are all-reduced and the ``cat:`` rows gathered in rank order;
    rank 0 calls ``finalize_statistics`` and broadcasts the resulting state, which every rank loads.
    Every rank must enter, even one that saw no batch. Returns what the training log records: the
    method's ``subspace_report()`` and the sha256 of the state on every rank (checked to be equal);
    None when no rank produced a statistic.
    """
    sums: dict[str, torch.Tensor] | None = None
    rows: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for batch in batches:
            stats = method.statistics(batch.to(dist.device()))
            if stats is None:
                continue
            for k in [k for k in stats if k.startswith("cat:")]:
                rows.setdefault(k, []).append(stats.pop(k).detach().cpu())
            if sums is None:
                sums = {k: v.detach().double().cpu().clone() for k, v in stats.items()}
            else:
                for k, v in stats.items():
                    sums[k] += v.detach().double().cpu()
    keys = dist.broadcast_object(sorted(sums) if sums is not None else None)
    shapes = dist.broadcast_object({k: tuple(v.shape) for k, v in sums.items()} if sums else None)
    if keys is None:  # no rank produced a statistic: nothing to finalise
        return None
    sums = {k: (sums[k] if sums and k in sums else torch.zeros(shapes[k], dtype=torch.float64)) for k in keys}
    for k in keys:
        dist.all_reduce_sum(sums[k])
    local = {k: torch.cat(v) for k, v in rows.items()}
    for part in dist.gather_objects(local) if dist.world_size() > 1 else [local]:
        for k, v in part.items():
            sums[k] = torch.cat([sums[k], v]) if k in sums else v
    if dist.is_main():
        method.finalize_statistics(sums, task)
    state = dist.broadcast_object({k: v.cpu() for k, v in method.state_dict().items()} if dist.is_main() else None)
    method.load_state_dict(state)
    # Every rank must now hold the same bases, bit for bit: check it rather than assume it.
    digests = dist.gather_objects(state_digest(method.state_dict()))
    if len(set(digests)) != 1:
        raise RuntimeError(f"subspace stage of task {task}: the method state differs between ranks after the broadcast")
    return {**method.subspace_report(), "state_sha256_per_rank": digests}


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for k in sorted(state):
        v = state[k].detach().cpu().contiguous()
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}".encode())
        h.update(v.reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()
