"""Per-class Gaussian feature statistics and replay from them, shared by several methods.

HiDe-Prompt / NoRGa (task-adaptive prediction, TII alignment) and VPT-NSP²'s CLIP variant (head
refinement) store a mean and covariance (or variance) per class of some feature and later train a
head on samples drawn from every seen class's Gaussian. The moments are additive, so they come from
the pipeline's subspace stage (summed over batches and ranks); fitting and sampling run on rank 0.
"""

from __future__ import annotations

import torch


def class_moments(onehot: torch.Tensor, feats: torch.Tensor, covariance: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class sums and second moments of one batch (float64): (C, D) and (C, D, D) or (C, D)."""
    onehot, f = onehot.double(), feats.double()
    if covariance:
        return onehot.t() @ f, torch.einsum("bc,bd,be->cde", onehot, f, f)
    return onehot.t() @ f, onehot.t() @ (f * f)


def moments_to_gaussians(n: torch.Tensor, sums: torch.Tensor, outer: torch.Tensor,
                         ridge: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased covariance (or variance, for (C, D) ``outer``) plus ``ridge`` on the diagonal."""
    n, sums, outer = n.detach().double().clamp_min(2).view(-1, 1), sums.detach(), outer.detach()
    mean = sums / n
    if outer.dim() == 3:
        centred = outer - n.view(-1, 1, 1) * torch.einsum("cd,ce->cde", mean, mean)
        cov = centred / (n.view(-1, 1, 1) - 1) + ridge * torch.eye(mean.shape[1], dtype=mean.dtype)
    else:
        cov = (outer - n * mean * mean) / (n - 1) + ridge
    return mean, cov


def gaussian_factors(means: torch.Tensor, covs: torch.Tensor, classes: list[int]
                     ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(class, mean, scale) with x = mean + z @ scale a sample (a 1-D scale for a diagonal covariance:
    x = mean + z * scale, no D x D matrix per class); one Cholesky per class, done once."""
    out = []
    for c in classes:
        cov = covs[c].double().cpu()
        scale = torch.linalg.cholesky(cov).t() if cov.dim() == 2 else cov.sqrt()
        out.append((c, means[c].double().cpu(), scale))
    return out


def sample_classes(factors: list, per_class: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_class`` samples of every class's Gaussian (float32) and their class indices."""
    xs, ys = [], []
    for c, mean, scale in factors:
        z = torch.randn(per_class, mean.shape[0], generator=g, dtype=torch.float64)
        xs.append(mean + (z @ scale if scale.dim() == 2 else z * scale))
        ys.append(torch.full((per_class,), c, dtype=torch.long))
    return torch.cat(xs).float(), torch.cat(ys)


def fit_mixture(x: torch.Tensor, components: int, iters: int, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A diagonal-covariance mixture of Gaussians fitted to rows ``x`` (n, D) by EM (scikit-learn's
    GaussianMixture, k-means initialised). Returns weights (K,), means (K, D), variances (K, D),
    zero-padded to ``components`` when a class has fewer samples than components.

    STAR-Prompt's official code fits with a port of gmm-torch whose diagonal log-likelihood uses
    1/sqrt(var) where 1/var belongs (and the matching log-determinant); a maintained EM avoids that.
    """
    from sklearn.mixture import GaussianMixture

    x = x.detach().double().cpu().numpy()
    k = max(1, min(components, x.shape[0]))
    gm = GaussianMixture(n_components=k, covariance_type="diag", max_iter=iters, random_state=seed,
                         reg_covar=1e-6).fit(x)
    d = x.shape[1]
    w, mu, var = torch.zeros(components), torch.zeros(components, d), torch.ones(components, d)
    w[:k] = torch.from_numpy(gm.weights_).float()
    mu[:k] = torch.from_numpy(gm.means_).float()
    var[:k] = torch.from_numpy(gm.covariances_).float()
    return w, mu, var


def sample_mixture(weights: torch.Tensor, means: torch.Tensor, variances: torch.Tensor, n: int,
                   g: torch.Generator) -> torch.Tensor:
    """``n`` samples (n, D) of one diagonal mixture: components drawn by weight, then each Gaussian."""
    comp = torch.multinomial(weights.double().cpu(), n, replacement=True, generator=g)
    z = torch.randn(n, means.shape[1], generator=g, dtype=torch.float64)
    return (means.double().cpu()[comp] + z * variances.double().cpu()[comp].sqrt()).float()
