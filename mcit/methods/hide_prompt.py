"""HiDe-Prompt (Wang et al., NeurIPS 2023, "Hierarchical Decomposition of Prompt-Based Continual
Learning"), as in the paper and thu-ml/HiDe-Prompt.

Three parts, all per sample at inference:
  * task-identity inference (TII): an MLP head on the frozen backbone's [CLS] feature
    (x -> LayerNorm(x + MLP(x)) -> linear over all classes, the official ``MlpMapping`` with hidden
    widths ``tii_mlp`` x D) trained with the current task's classes; its predicted class gives the task,
    whose E-prompt is then used;
  * within-task prediction (WTP): one E-prefix per task (prefix tuning on ``e_layers``, default 0-4)
    and a linear head on the prompted [CLS] feature. Task t > 0's prompt starts as a copy of task
    t-1's (the official engine's hand-over, ``shared_prompt_pool``). From task 1 on the prompt the
    forward reads in training is (1 - m) P_t + m mean(P_0..P_{t-1}) (prompt momentum m), and the same
    mix is written into P_t after training; the class statistics then read the stored P_t as it is
    (the official ``_compute_mean`` calls the model with momentum 0);
    the contrastive regulariser ``reg`` pulls each feature to itself and away from the stored class
    means of earlier tasks (temperature 0.8, the official ``orth_loss``);
  * task-adaptive prediction (TAP): after each task t > 0 both heads are re-trained on samples drawn
    from stored per-class Gaussians of every class seen so far: the TII head on frozen features, the
    WTP head on prompted features (each class through its own task's prompt). ``ca_storage``:
    ``multi-centroid`` (the official default) k-means with ``n_centroids`` clusters per class, each a
    diagonal Gaussian with the cluster's population variance + 1e-4, zero-variance clusters skipped;
    ``covariance`` (what NoRGa's scripts run) one full Gaussian per class, torch.cov + 1e-4 I;
    ``variance`` its diagonal. SGD, momentum 0.9, cosine schedule, weight decay ``ca_weight_decay`` = 0:
    the official optimizer is built with 5e-4, but its parameter group sets ``args.weight_decay``, which
    is 0.0 in the official runs (``--weight-decay``, default 0.0, is declared before ``--weight_decay``
    and argparse keeps the first default).

The class statistics come from the pipeline's subspace stage (summed over ranks, or for
``multi-centroid`` every feature gathered to rank 0; rank 0 fits the Gaussians and runs TAP, seeded,
then the state is broadcast). With ``multi-centroid`` the contrastive term reads every stored centroid,
as the official ``orth_loss`` does with its lists of cluster means. k-means is scikit-learn's with
``n_init=10`` (the default of the official requirements' scikit-learn 1.0.2) and a seeded RandomState
running through the task's classes in order, where the official code draws from numpy's global one; a
class with fewer samples than ``n_centroids`` keeps that many clusters (the official code stops).
Differences from the official code, and why: the TII head is trained in the same pass as the prompts
(with its own learning rate, ``tii_lr_scale``) instead of a separate run; the prefix is built with a
permute, not the public reshape (docs/architecture.md, "Known faults").
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import LayerList, LossTerms, Method, MethodParams
from mcit.methods.class_gaussians import class_moments, gaussian_factors, moments_to_gaussians, sample_classes
from mcit.methods.prompting import (
    HEAD_INIT_DOC,
    HeadInit,
    classifier_head,
    gather_prefix,
    mask_to_classes,
    prefix_prompt,
    uniform_,
)


class HiDePromptParams(MethodParams):
    prompt_length: int = Field(5, ge=1, description="E-prefix length: 5 for CIFAR-100, 20 for ImageNet-R / CUB")
    e_layers: LayerList = Field(default_factory=lambda: [0, 1, 2, 3, 4], description="blocks with the E-prefix")
    prompt_momentum: float = Field(0.01, ge=0, le=1, description="m of the prompt mix (1 - m) P_t + m "
                                                                 "mean(P_0..P_{t-1}) from task 1 on (0: off)")
    reg: float = Field(0.1, ge=0, description="weight of the contrastive regulariser")
    reg_temperature: float = Field(0.8, gt=0, description="temperature of the contrastive regulariser (the "
                                                          "official orth_loss)")
    head_lr_scale: float = Field(0.1, gt=0, description="head lr / prompt lr (the official larger_prompt_lr)")
    tii_mlp: list[int] = Field(default_factory=lambda: [2], description="TII MLP hidden widths, multiples of D")
    tii_lr_scale: float = Field(1.0, gt=0, description="TII head lr / prompt lr")
    head_init: HeadInit = Field("timm", description=HEAD_INIT_DOC)
    ca_storage: Literal["multi-centroid", "covariance", "variance"] = Field(
        "multi-centroid", description="class statistics for TAP (official default multi-centroid)")
    n_centroids: int = Field(10, ge=1, description="k-means clusters per class with ca_storage multi-centroid")
    ca_epochs: int = Field(30, ge=0, description="TAP epochs after each task > 0 (0 disables TAP)")
    ca_lr: float = Field(0.005, gt=0, description="TAP lr (the prompted head's alignment)")
    tii_ca_epochs: int | None = Field(None, ge=0, description="TII head alignment epochs; default ca_epochs (the "
                                                              "official TII run's crct_epochs)")
    tii_ca_lr: float | None = Field(None, gt=0, description="TII head alignment lr; default ca_lr (the official TII "
                                                            "run's ca_lr, which NoRGa's scales by batch / 256)")
    ca_batch_size: int = Field(24, ge=1, description="TAP draws 5x this per class and epoch (TII: 1x)")
    ca_weight_decay: float = Field(0.0, ge=0, description="TAP's SGD weight decay (official runs: 0.0)")
    shared_prompt_pool: bool = Field(True, description="task t's E-prompt starts as task t-1's (official default)")
    train_mask: bool = Field(True, description="mask the logits of classes outside the current task in training "
                                               "(both heads)")


class TIIHead(nn.Module):
    """x -> LayerNorm(x + MLP(x)) -> linear over all classes (the official MlpMapping + head)."""

    def __init__(self, d: int, hidden: list[int], num_classes: int, head_init: HeadInit = "torch") -> None:
        super().__init__()
        widths = [d] + [d * h for h in hidden] + [d]
        layers: list[nn.Module] = []
        for i in range(len(widths) - 1):
            layers.append(nn.Linear(widths[i], widths[i + 1]))
            if i < len(widths) - 2:
                layers.append(nn.GELU())
        self.mlp = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(d)
        self.head = classifier_head(d, num_classes, head_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x + self.mlp(x)))


def _cosine_lr(base: float, epoch: int, total: int) -> float:
    return base * 0.5 * (1 + math.cos(math.pi * epoch / total))


@METHODS.register("hide_prompt")
class HiDePrompt(Method):
    name = "hide_prompt"
    Params = HiDePromptParams
    has_subspace_stage = True

    def __init__(self, params: HiDePromptParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        d, c, T = backbone.hidden_size, sequence.num_classes, len(sequence)
        self.e_prompt = uniform_((len(params.e_layers), 2, T, params.prompt_length, backbone.num_heads,
                                  backbone.head_dim))
        self.head = classifier_head(d, c, params.head_init)
        self.tii = TIIHead(d, params.tii_mlp, c, params.head_init)  # the official TII head is a timm ViT's too
        task_of = torch.zeros(c, dtype=torch.long)
        for t, info in enumerate(sequence.tasks):
            task_of[list(info.classes)] = t
        self.register_buffer("task_of_class", task_of, persistent=False)
        k = params.n_centroids
        mean_shape = (c, k, d) if params.ca_storage == "multi-centroid" else (c, d)
        cov_shape = {"covariance": (c, d, d), "variance": (c, d), "multi-centroid": (c, k, d)}[params.ca_storage]
        for kind in ("frozen", "prompted"):
            self.register_buffer(f"{kind}_mean", torch.zeros(mean_shape))
            self.register_buffer(f"{kind}_cov", torch.zeros(cov_shape))
            if params.ca_storage == "multi-centroid":  # which of a class's k slots hold a cluster
                self.register_buffer(f"{kind}_used", torch.zeros(c, k, dtype=torch.bool))
        self.register_buffer("seen", torch.zeros(c, dtype=torch.bool))
        self.register_buffer("init_seed", torch.randint(0, 2**31 - 1, ()))
        self.ca_log: dict[str, float] = {}

    def param_groups(self) -> list[dict]:
        return [{"params": [self.e_prompt]},
                {"params": list(self.head.parameters()), "lr_scale": self.params.head_lr_scale},
                {"params": list(self.tii.parameters()), "lr_scale": self.params.tii_lr_scale}]

    # -- prompts -----------------------------------------------------------------------------------
    def _train_prefix(self, task: int, batch: int) -> torch.Tensor:
        """Task ``task``'s E-prefix with prompt momentum: (layers, B, 2, L, H, hd)."""
        p = self.e_prompt[:, :, task]
        m = self.params.prompt_momentum
        if task > 0 and m > 0:
            p = (1 - m) * p + m * self.e_prompt[:, :, :task].detach().mean(dim=2)
        return p.unsqueeze(1).expand(-1, batch, -1, -1, -1, -1)

    def before_task(self, task: int) -> None:
        super().before_task(task)
        if task > 0 and self.params.shared_prompt_pool:
            with torch.no_grad():  # the official hand-over (a resumed task reloads its own prompt afterwards)
                self.e_prompt[:, :, task] = self.e_prompt[:, :, task - 1]

    def after_task(self, task: int) -> None:
        m = self.params.prompt_momentum
        if task > 0 and m > 0:
            with torch.no_grad():
                old = self.e_prompt[:, :, :task].mean(dim=2)
                self.e_prompt[:, :, task] = (1 - m) * self.e_prompt[:, :, task] + m * old

    def gate(self, layer_index: int):
        """Score rewrite for the prefix columns of e_layers[layer_index] (None: plain prefix tuning)."""
        return None

    def prompted_features(self, pixel_values: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        prompts = {}
        for i, layer in enumerate(self.params.e_layers):
            lp = prefix_prompt(prefix[i])
            lp.score_fn = self.gate(i)
            prompts[layer] = lp
        return self.backbone.encode(self.backbone.embed(pixel_values), prompts)[:, 0]

    # -- training ----------------------------------------------------------------------------------
    def train_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        x = batch.pixel_values
        frozen = self.backbone.cls_features(x)
        feats = self.prompted_features(x, self._train_prefix(batch.task, x.shape[0]))
        return {"logits": self.head(feats), "tii_logits": self.tii(frozen.to(self.head.weight.dtype)), "feats": feats}

    def contrastive(self, feats: torch.Tensor) -> torch.Tensor:
        """The official orth_loss: each row of [stored class means; features] classifies itself."""
        if self.params.ca_storage == "multi-centroid":
            means = self.prompted_mean[self.prompted_used & self.seen.unsqueeze(1)]  # every centroid, class order
        else:
            means = self.prompted_mean[self.seen]
        m = torch.cat([means.to(feats), feats], dim=0)
        if m.shape[0] == 0:  # a micro-batch of padding alone before any class is stored (only this pipeline's
            return feats.sum() * 0.0  # padding makes one): 0, not the NaN mean of an empty cross-entropy
        sim = m @ m.t() / self.params.reg_temperature
        return F.cross_entropy(sim, torch.arange(m.shape[0], device=m.device))

    def loss(self, batch: Batch, outputs: dict[str, torch.Tensor]) -> LossTerms:
        classes = self.sequence.tasks[batch.task].classes
        logits, tii = outputs["logits"].float(), outputs["tii_logits"].float()
        if self.params.train_mask:
            logits, tii = mask_to_classes(logits, classes), mask_to_classes(tii, classes)
        ce = F.cross_entropy(logits, batch.labels, reduction="none")
        tii_ce = F.cross_entropy(tii, batch.labels, reduction="none")
        reg = None
        if self.params.reg > 0:
            reg = self.params.reg * self.contrastive(outputs["feats"][batch.valid.bool()].float())
        return LossTerms(per_sample=ce + tii_ce, regularizer=reg, task=ce,
                         logs={"wtp_ce": float(ce.detach().mean()), "tii_ce": float(tii_ce.detach().mean())})

    # -- inference ---------------------------------------------------------------------------------
    @torch.no_grad()
    def infer_task(self, batch: Batch) -> torch.Tensor:
        """Per-sample task identity from the TII head's class prediction over the allowed classes."""
        tii = self.tii(self.backbone.cls_features(batch.pixel_values).to(self.head.weight.dtype))
        return self.task_of_class.to(tii.device)[self.restrict(tii, batch).argmax(dim=-1)]

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        task = self.infer_task(batch)
        feats = self.prompted_features(batch.pixel_values, gather_prefix(self.e_prompt, task.unsqueeze(1)))
        return self.restrict(self.head(feats), batch).argmax(dim=-1)

    # -- class statistics and task-adaptive prediction -------------------------------------------------
    def statistics(self, batch: Batch) -> dict[str, torch.Tensor]:
        t = self.current_task
        valid = batch.valid.bool()
        x, y = batch.pixel_values[valid], batch.labels[valid]
        classes = torch.tensor(self.sequence.tasks[t].classes, device=y.device)
        onehot = (y.unsqueeze(1) == classes.unsqueeze(0)).double()  # (B, C_t)
        out = {"n": onehot.sum(0)}
        # the stored prompt as after_task left it (momentum already mixed in; not applied again)
        prefix = self.e_prompt[:, :, t].unsqueeze(1).expand(-1, x.shape[0], -1, -1, -1, -1)
        feats = {"frozen": self.backbone.cls_features(x), "prompted": self.prompted_features(x, prefix)}
        if self.params.ca_storage == "multi-centroid":  # k-means needs the features themselves
            out = {f"cat:{kind}": f.float().cpu() for kind, f in feats.items()}
            out["cat:labels"] = y.cpu()
            return out
        for kind, f in feats.items():
            out[f"{kind}_sum"], out[f"{kind}_outer"] = class_moments(onehot, f, self.params.ca_storage == "covariance")
        return out

    def kmeans_seed(self, task: int) -> int:
        return (int(self.init_seed) + 7919 * task) % 2**31

    def finalize_statistics(self, reduced: dict[str, torch.Tensor], task: int) -> None:
        classes = list(self.sequence.tasks[task].classes)
        for kind in ("frozen", "prompted"):
            if self.params.ca_storage == "multi-centroid":
                self._fit_centroids(kind, reduced[f"cat:{kind}"], reduced["cat:labels"].long(), classes,
                                    np.random.RandomState(self.kmeans_seed(task)))
                continue
            mean, cov = moments_to_gaussians(reduced["n"], reduced[f"{kind}_sum"], reduced[f"{kind}_outer"])
            getattr(self, f"{kind}_mean")[classes] = mean.to(self.head.weight.dtype).cpu().to(self.seen.device)
            getattr(self, f"{kind}_cov")[classes] = cov.to(self.head.weight.dtype).cpu().to(self.seen.device)
        self.seen[classes] = True
        p = self.params
        tii_epochs = p.ca_epochs if p.tii_ca_epochs is None else p.tii_ca_epochs
        tii_lr = p.ca_lr if p.tii_ca_lr is None else p.tii_ca_lr
        if task > 0:
            g = torch.Generator().manual_seed(int(self.init_seed) + 104729 * task)
            self.ca_log = {}
            if tii_epochs > 0:
                self.ca_log["tii_ca_loss"] = self._align(self.tii, "frozen", task, p.ca_batch_size, g, tii_lr,
                                                         tii_epochs)
            if p.ca_epochs > 0:
                self.ca_log["tap_loss"] = self._align(self.head, "prompted", task, 5 * p.ca_batch_size, g, p.ca_lr,
                                                      p.ca_epochs)

    def _fit_centroids(self, kind: str, feats: torch.Tensor, labels: torch.Tensor, classes: list[int],
                       rs: np.random.RandomState) -> None:
        """The official multi-centroid ``_compute_mean``: k-means per class, each cluster's mean and
        population variance, all in float32 as there (the official features are float32 numpy arrays)."""
        from sklearn.cluster import KMeans

        means, variances, used = (getattr(self, f"{kind}_{n}") for n in ("mean", "cov", "used"))
        for c in classes:
            x = feats[labels == c].detach().float().cpu().numpy()
            if len(x) == 0:
                raise ValueError(f"hide_prompt: no training sample of class {c} reached the class statistics")
            k = min(self.params.n_centroids, len(x))
            assign = KMeans(n_clusters=k, n_init=10, random_state=rs).fit(x).labels_
            means[c], variances[c], used[c] = 0.0, 0.0, False
            for i in range(k):
                members = x[assign == i]
                means[c, i] = torch.from_numpy(np.mean(members, axis=0)).to(means.dtype)
                variances[c, i] = torch.from_numpy(np.var(members, axis=0)).to(means.dtype)
                used[c, i] = True

    def replay_gaussians(self, kind: str) -> list:
        """(class, mean, scale) per Gaussian to draw from: one per class, or one per non-degenerate cluster."""
        seen = torch.nonzero(self.seen).flatten().tolist()
        means, covs = getattr(self, f"{kind}_mean"), getattr(self, f"{kind}_cov")
        if self.params.ca_storage != "multi-centroid":
            return gaussian_factors(means, covs, seen)
        used = getattr(self, f"{kind}_used")
        return [(c, means[c, i].double().cpu(), (covs[c, i].double().cpu() + 1e-4).sqrt())
                for c in seen for i in range(self.params.n_centroids)
                if used[c, i] and float(covs[c, i].double().mean()) != 0.0]  # official: `if var.mean() == 0: continue`

    def _align(self, module: nn.Module, kind: str, task: int, per_class: int, g: torch.Generator, lr: float,
               epochs: int) -> float:
        """The official train_task_adaptive_prediction: SGD on Gaussian samples of every seen class."""
        dev = self.seen.device
        module.train()
        opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9, weight_decay=self.params.ca_weight_decay)
        steps = sum(len(self.sequence.tasks[i].classes) for i in range(task))  # the official crct_num
        allowed = self.seen.to(dev)
        factors = self.replay_gaussians(kind)
        if not factors:  # every cluster a single sample (the official code stops on an empty torch.cat)
            raise ValueError(f"hide_prompt: no class of tasks 0-{task} has a cluster of two or more samples to "
                             f"draw from; lower method.n_centroids ({self.params.n_centroids})")
        loss = torch.zeros(())
        for epoch in range(epochs):
            for group in opt.param_groups:
                group["lr"] = _cosine_lr(lr, epoch, epochs)
            x, y = sample_classes(factors, per_class, g)
            perm = torch.randperm(len(y), generator=g)
            x, y = x[perm].to(dev), y[perm].to(dev)
            for i in range(steps):
                xb, yb = x[i * per_class:(i + 1) * per_class], y[i * per_class:(i + 1) * per_class]
                if len(yb) == 0:
                    break
                with torch.enable_grad():
                    logits = module(xb.to(self.head.weight.dtype)).float().masked_fill(~allowed, float("-inf"))
                    loss = F.cross_entropy(logits, yb)
                    opt.zero_grad()
                    loss.backward()
                opt.step()
        module.eval()
        return float(loss.detach())

    def subspace_report(self) -> dict:
        return dict(self.ca_log)
