"""Subspace linear algebra the methods share: streamed covariances and energy-threshold bases.

A task's embeddings are never held: each batch adds ``X^T X`` (d x d, float64) of its valid tokens to a
running sum (``token_covariance``), and the d x d matrix is decomposed once. ``eigh`` of the covariance
gives the same left singular vectors and squared singular values as an SVD of the stacked embeddings, at
O(d^2) memory instead of O(n d) (GPM-style energy bases: ``energy_basis``, ``project_out``). The stage
that streams, reduces and broadcasts these over ranks is ``mcit/run/subspace_stage.py``.
"""

from __future__ import annotations

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
