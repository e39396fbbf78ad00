"""The subspace stage: streamed statistics, their reduction over ranks, and energy-threshold subspaces.

The stage never holds a task's embeddings: each batch adds ``X^T X`` (d x d, float64) of its valid
tokens to a running sum; ``stream_statistics`` all-reduces the sums over ranks and rank 0 decomposes
the d x d matrix once, then broadcasts the method state. ``eigh`` of the covariance gives the same
left singular vectors and squared singular values as an SVD of the stacked embeddings, at O(d^2)
memory instead of O(n d) (GPM-style energy bases: ``energy_basis``, ``project_out``).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def token_covariance(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of x x^T over the valid tokens (d, d) float64, number of tokens) of one batch."""
    x = embeds.reshape(-1, embeds.shape[-1])[mask.reshape(-1).bool()].double()
    return x.T @ x, torch.tensor(float(x.shape[0]), dtype=torch.float64)


def energy_basis(cov: torch.Tensor, eps: float, existing: torch.Tensor | None = None) -> torch.Tensor:
    """New orthonormal directions (d, k) that, with ``existing`` (d, m), hold a fraction ``eps`` of the
    energy tr(cov). As in GPM (Saha et al. 2021): the energy ``existing`` already captures counts, the
    rest is taken from the eigenvectors of the residual covariance, largest first; returns (d, 0)
    when ``existing`` is already enough."""
    cov = cov.double()
    d = cov.shape[0]
    total = float(torch.trace(cov))
    if total <= 0:
        return cov.new_zeros(d, 0)
    if existing is not None and existing.shape[1] > 0:
        U = existing.double()
        captured = float(torch.trace(U.T @ cov @ U))
        R = torch.eye(d, dtype=torch.float64, device=cov.device) - U @ U.T
        res = R @ cov @ R
    else:
        captured, res = 0.0, cov
    if captured >= eps * total:
        return cov.new_zeros(d, 0)
    vals, vecs = torch.linalg.eigh((res + res.T) / 2)
    vals, vecs = vals.flip(0).clamp_min(0), vecs.flip(1)
    need = eps * total - captured
    csum = torch.cumsum(vals, 0)
    k = int(torch.searchsorted(csum, torch.tensor(need, dtype=torch.float64, device=csum.device)).item()) + 1
    k = min(k, d - (existing.shape[1] if existing is not None else 0))
    new = vecs[:, :k]
    if existing is not None and existing.shape[1] > 0:  # re-orthogonalise against round-off
        new = new - existing.double() @ (existing.double().T @ new)
        new, _ = torch.linalg.qr(new)
    return new


def project_out(delta: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``delta`` (..., d) with its component in span(basis) (d, k) removed: delta (I - B B^T)."""
    if basis.shape[1] == 0:
        return delta
    B = basis.to(delta.dtype)
    return delta - (delta @ B) @ B.T


# --------------------------------------------------------------------------------------------------
# The subspace stage's protocol: stream on every rank, all-reduce, finalise on rank 0, broadcast

def stream_statistics(method: Any, batches: Iterable[Any], task: int) -> dict[str, Any] | None:
    """Run the subspace stage of ``task`` (-1: the reference set) over this rank's ``batches``.

    Every rank sums ``method.statistics`` over its batches (float64 on the CPU; ``cat:`` keys are
    concatenated instead); the sums are all-reduced and the ``cat:`` rows gathered in rank order;
    rank 0 calls ``finalize_statistics`` and broadcasts the resulting state, which every rank loads.
    Every rank must enter, even one that saw no batch. Returns what the training log records: the
    method's ``subspace_report()`` and the sha256 of the state on every rank (checked to be equal);
    None when no rank produced a statistic.
    """
    from mcit import distributed as dist

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
    import hashlib

    h = hashlib.sha256()
    for k in sorted(state):
        v = state[k].detach().cpu().contiguous()
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}".encode())
        h.update(v.reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()
