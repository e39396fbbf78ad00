"""VPT-NSP² (Lu et al., NeurIPS 2024, "Visual Prompt Tuning in Null Space for Continual Learning"),
as in the paper and its official code (zugexiaodui/VPTinNSforCL).

VPT-deep: every prompted block i gets its own ``prompt_length`` tokens P_i appended to its input;
they go through the block's LayerNorm and attention (as keys and values) and are dropped from its
output, so they act on the image tokens only through attention. Per-task linear heads (trained on
``logits / temperature`` over the task's own classes; inference concatenates all heads so far).

After each task the subspace stage accumulates, per prompted block and over all tasks so far, the
uncentred covariances of
  * Q_X W_k (stacked over heads: each image token's per-head query times that head's key
    projection, a D-vector), and
  * S_P, the attention of every image token (per head) to the prompt tokens (an L-vector),
both summed over ranks. Their eigen-decompositions give null spaces by the official code's
criterion (``adaptive``: the knee of the singular-value curve found by the largest second
difference, Gaussian-smoothed when there are >= 128 values; ``times``: singular values at most
``thres`` times the smallest). With U0 the null-space basis, B = U0 U0^T / ||U0 U0^T||_F (the
official normalisation) and P = eta * B + (1 - eta) * I, the optimizer's update of P_i becomes
P2 Delta P1 (P1 from Q_X W_k, D x D; P2 from S_P, L x L), applied to the update itself as the
official ModAdam does. From the second task on, the L_LN loss keeps each prompt token's mean and
standard deviation (over D) at the previous task's values, which keeps the LayerNorm in front of the
attention close to linear -- the assumption the null-space conditions rest on.

Ablations (the paper's): ``project_qk: false`` drops condition B1 (P1 = I), ``project_sp: false``
drops B2 (P2 = I), ``ln_loss_coeff: 0`` turns L_LN off, ``eta1 != eta2`` weighs the two separately,
``eta`` sets both (the stability-plasticity curve), ``null_space: false`` is plain sequential VPT.

CLIP variant (the paper's CLIP rows; official ``train_*_clip.sh``): the same prompts and
projections on CLIP's image encoder (``layers`` = the first blocks, eta 0.98), and the classifier is
CLIP's own: logits = exp(logit_scale) * cos(W_proj h_cls, t_c) with t_c the class names' text
embeddings (template-averaged) and W_proj initialised from CLIP's visual projection, with a bias
initialised to zero (the official code loads CLIP through timm's OpenAI conversion, which adds one;
``head_bias: false`` drops it). Training updates the prompts and the logit scale only; with
``refine_head`` the subspace stage also stores each class's mean and covariance of h_cls and then
retrains W_proj and its bias on samples of every seen class, as the official ``refine_head``: timm's
``sgd`` (Nesterov momentum 0.9), lr 0.001, weight decay 1e-4 on the weight only (timm exempts biases),
50 epochs of 256 samples per class. The refinement reads the logit scale without training it and
leaves no gradient on it for the next task's first step (the official loop zeroes gradients before
every backward; DeepSpeed would add a left-over one). The zero-shot row is plain zero-shot CLIP (no prompts).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import LayerList, LossTerms, Method, MethodParams
from mcit.methods.class_gaussians import class_moments, gaussian_factors, moments_to_gaussians, sample_classes
from mcit.methods.prompting import mask_to_classes, uniform_
from mcit.models.base import LayerPrompt


class VPTNSP2Params(MethodParams):
    prompt_length: int = Field(4, ge=1, description="prompt tokens appended to each prompted block's input")
    layers: LayerList | None = Field(None, description="prompted blocks; default all (VPT-deep)")
    null_space: bool = Field(True, description="false: plain sequential VPT-deep with per-task heads "
                                               "(no projection, no L_LN)")
    eta1: float = Field(0.97, ge=0, le=1, description="weight of the null-space projection P1 (Q_X W_k)")
    eta2: float = Field(0.97, ge=0, le=1, description="weight of the null-space projection P2 (S_P)")
    eta: float | None = Field(None, ge=0, le=1, description="sets eta1 and eta2 together, over their own values (the "
                                                             "paper's one eta: its stability-plasticity curve)")
    project_qk: bool = Field(True, description="ablation B1: the projection from Q_X W_k (P1); false = P1 is I")
    project_sp: bool = Field(True, description="ablation B2: the projection from S_P (P2); false = P2 is I")
    thres_mode: str = Field("adaptive", pattern="^(adaptive|times)$",
                            description="null-space criterion: the knee of the singular values (adaptive) or "
                                        "those at most thres times the smallest (times)")
    thres1: float = Field(0.0, description="adaptive: offset of the knee (fraction < 1 or count); times: multiple")
    thres2: float = Field(0.0, description="as thres1, for the projection P2 (S_P); thres1 is P1's")
    ln_loss_coeff: float = Field(1.0, ge=0, description="weight of the L_LN loss, from the second task on (0: off)")
    temperature: float = Field(28.0, gt=0, description="training logits are divided by it")
    classifier: Literal["auto", "linear", "text"] = Field(
        "auto", description="linear heads, or CLIP's image-text similarity (auto: text on a CLIP backbone)")
    templates: list[str] = Field(default_factory=lambda: ["a photo of a {}."],
                                 description="text classifier: class-name templates, averaged")
    logit_scale_trainable: bool = Field(True, description="text classifier: train CLIP's logit scale with the "
                                                          "prompts")
    head_bias: bool = Field(True, description="text classifier: W_proj has a zero-initialised bias (the official "
                                              "timm conversion of CLIP), trained by refine_head only")
    refine_head: bool = Field(False, description="text classifier: retrain the projection on class Gaussians")
    refine_epochs: int = Field(50, ge=0, description="refine_head epochs (official 50)")
    refine_lr: float = Field(0.001, gt=0, description="refine_head SGD lr (official 0.001)")
    refine_samples: int = Field(256, ge=1, description="samples per class and epoch")

    @model_validator(mode="after")
    def _one_eta(self) -> "VPTNSP2Params":
        if self.eta is not None:  # overrides eta1 / eta2 (a config's own values included)
            self.eta1 = self.eta2 = self.eta
        return self


def null_space_start(svals: np.ndarray, mode: str, value: float) -> int:
    """Index of the first singular value (descending order) of the null space, as the official code."""
    points = np.asarray(svals, dtype=np.float64)
    n = len(points)
    if mode == "times":
        return int(np.argmax(points <= points[-1] * int(value)))
    if n < 3:  # no second difference to take (the official code fails here): the smallest direction
        return n - 1
    if n >= 128:
        from scipy.ndimage import gaussian_filter1d

        smooth = gaussian_filter1d(points, sigma=10)
        d2 = np.diff(smooth, 2)  # (p0 - p1) - (p1 - p2): the official "diff_o2"
        drop = int(n * 0.03 / 2)
        valid = d2[drop:len(d2) - drop]
        thres = points[int(np.argmax(valid)) + int((n - len(valid)) / 2)]
    else:
        d2 = np.diff(points, 2)
        thres = points[int(np.argmax(d2)) + int((n - len(d2)) / 2)]
    i = int(np.arange(n)[points >= thres].max())
    if 0 <= value < 1:
        i = min(i + int(value * (n - i)), n - 1)
    else:
        i = max(min(i + int(value), n - 1), 0)
    return i


def null_projection(cov: torch.Tensor, mode: str, thres: float, eta: float) -> tuple[torch.Tensor, int]:
    """P = eta * B + (1 - eta) * I with B the Frobenius-normalised projector on the null space of ``cov``."""
    vals, vecs = torch.linalg.eigh(cov.detach().double())
    vals, vecs = vals.flip(0).clamp_min(0), vecs.flip(1)  # descending, like the official SVD
    start = null_space_start(vals.cpu().numpy(), mode, thres)
    u0 = vecs[:, start:]
    b = u0 @ u0.t()
    b = b / torch.linalg.norm(b)
    eye = torch.eye(cov.shape[0], dtype=torch.float64)
    return (eta * b + (1 - eta) * eye).float(), u0.shape[1]


@METHODS.register("vpt_nsp2")
class VPTNSP2(Method):
    name = "vpt_nsp2"
    Params = VPTNSP2Params
    has_subspace_stage = True
    projects_updates = True

    def __init__(self, params: VPTNSP2Params, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        self.layers = list(range(backbone.num_layers)) if params.layers is None else list(params.layers)
        n, L, d = len(self.layers), params.prompt_length, backbone.hidden_size
        self.prompt = uniform_((n, L, d))
        kind = params.classifier
        if kind == "auto":
            kind = "text" if hasattr(backbone, "class_text_features") else "linear"
        if kind == "text" and not hasattr(backbone, "class_text_features"):
            raise ValueError("method.classifier: text needs a backbone with a text encoder (backbone.kind: clip)")
        self.text_classifier = kind == "text"
        if self.text_classifier:
            proj = backbone.model.visual_projection
            self.head = nn.Linear(d, proj.out_features, bias=params.head_bias)
            with torch.no_grad():
                self.head.weight.copy_(proj.weight.float())
                if self.head.bias is not None:
                    self.head.bias.zero_()
            self.head.requires_grad_(False)  # trained only by refine_head, in the subspace stage
            self.logit_scale = nn.Parameter(backbone.logit_scale.detach().float().clone().reshape(1),
                                            requires_grad=params.logit_scale_trainable)
            names = list(sequence.class_names) or [str(c) for c in sequence.labels]
            self.register_buffer("text_feats", backbone.class_text_features(names, params.templates).float(),
                                 persistent=False)  # rebuilt from the frozen text encoder
            self.register_buffer("feat_mean", torch.zeros(sequence.num_classes, d))
            self.register_buffer("feat_cov", torch.zeros(sequence.num_classes, d, d))
            self.register_buffer("seen", torch.zeros(sequence.num_classes, dtype=torch.bool))
        else:
            self.head = nn.Linear(d, sequence.num_classes)
        self._prompts_on = True
        self.refine_log: dict[str, float] = {}
        self.register_buffer("prev_prompt", torch.zeros(n, L, d))
        self.register_buffer("cov1", torch.zeros(n, d, d, dtype=torch.float64))
        self.register_buffer("cov2", torch.zeros(n, L, L, dtype=torch.float64))
        self.register_buffer("proj1", torch.eye(d).repeat(n, 1, 1))
        self.register_buffer("proj2", torch.eye(L).repeat(n, 1, 1))
        self.register_buffer("tasks_projected", torch.zeros((), dtype=torch.long))
        self.null_dims: dict[str, list[int]] = {}

    def after_task(self, task: int) -> None:
        self.prev_prompt.copy_(self.prompt.detach())

    # -- forward -----------------------------------------------------------------------------------
    def hidden(self, pixel_values: torch.Tensor, capture: dict | None = None) -> torch.Tensor:
        """Final hidden states (B, T, D) with this method's prompts (``capture``: fill it with the statistics)."""
        b = pixel_values.shape[0]
        appended = {layer: self.prompt[i].unsqueeze(0).expand(b, -1, -1) for i, layer in enumerate(self.layers)}
        if not self._prompts_on:
            appended = None
        prompts = None
        if capture is not None:
            prompts = {layer: LayerPrompt(capture=self._capturer(i, layer, capture))
                       for i, layer in enumerate(self.layers)}
        return self.backbone.encode(self.backbone.embed(pixel_values), prompts=prompts, appended=appended)

    def classify(self, pooled: torch.Tensor, train_scale: bool = True) -> torch.Tensor:
        """Logits over every class from pooled features (B, D) (``train_scale=False``: the logit scale as a
        constant)."""
        out = self.head(pooled.to(self.head.weight.dtype))
        if self.text_classifier:
            scale = self.logit_scale if train_scale else self.logit_scale.detach()
            return scale.exp() * F.normalize(out.float(), dim=-1) @ self.text_feats.t()
        return out

    def logits(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Logits over every class of the prompted [CLS] feature."""
        return self.classify(self.hidden(pixel_values)[:, 0])

    @contextmanager
    def zero_shot(self) -> Iterator[None]:
        """Text classifier: zero-shot CLIP (no prompts); linear heads: the untrained method as built."""
        self._prompts_on = not self.text_classifier
        try:
            yield
        finally:
            self._prompts_on = True

    def train_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"logits": self.logits(batch.pixel_values)}

    def ln_loss(self) -> torch.Tensor:
        """L_LN: L1 distance of each prompt token's mean and std (over D) to the previous task's."""
        p, p0 = self.prompt, self.prev_prompt
        mean = (p.mean(-1) - p0.mean(-1)).abs().mean(-1)
        std = (p.std(-1, unbiased=False) - p0.std(-1, unbiased=False)).abs().mean(-1)
        return (mean + std).sum()

    def loss(self, batch: Batch, outputs: dict[str, torch.Tensor]) -> LossTerms:
        logits = mask_to_classes(outputs["logits"].float(), self.sequence.tasks[batch.task].classes)
        ce = F.cross_entropy(logits / self.params.temperature, batch.labels, reduction="none")
        reg = None
        if self.params.null_space and self.params.ln_loss_coeff > 0 and batch.task > 0:
            reg = self.params.ln_loss_coeff * self.ln_loss()
        return LossTerms(per_sample=ce, regularizer=reg)

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        return self.restrict(self.logits(batch.pixel_values), batch).argmax(dim=-1)

    # -- null-space projection ---------------------------------------------------------------------
    def project_update(self, name: str, delta: torch.Tensor) -> torch.Tensor | None:
        if name.startswith("head.") and not self.text_classifier:  # per-task heads: only this task's rows move
            keep = torch.zeros(delta.shape[0], dtype=torch.bool, device=delta.device)
            keep[list(self.sequence.tasks[self.current_task].classes)] = True
            return delta * keep.view(-1, *([1] * (delta.dim() - 1))).to(delta.dtype)
        if name == "prompt" and self.params.null_space and int(self.tasks_projected) > 0:
            p1, p2 = self.proj1.to(delta), self.proj2.to(delta)
            return p2 @ delta @ p1
        return None

    def _capturer(self, i: int, layer: int, out: dict) -> callable:
        L = self.params.prompt_length
        wk = self.backbone.key_proj(layer).weight  # (H * hd, D)
        h, hd = self.backbone.num_heads, self.backbone.head_dim

        def capture(query: torch.Tensor, probs: torch.Tensor) -> None:
            n = query.shape[2] - L  # image tokens ([CLS] + patches)
            qk = torch.einsum("bhnd,hde->bhne", query[:, :, :n].double(), wk.view(h, hd, -1).double())
            qk = qk.reshape(-1, qk.shape[-1])
            sp = probs[:, :, :n, n:].double().reshape(-1, L)
            out[f"qk_{i}"] = out.get(f"qk_{i}", 0) + qk.t() @ qk / (h * n)
            out[f"sp_{i}"] = out.get(f"sp_{i}", 0) + sp.t() @ sp / (h * n)

        return capture

    @property
    def _refines(self) -> bool:
        return self.text_classifier and self.params.refine_head

    def statistics(self, batch: Batch) -> dict[str, torch.Tensor] | None:
        if not (self.params.null_space or self._refines):
            return None
        out: dict[str, torch.Tensor] = {}
        valid = batch.valid.bool()
        hidden = self.hidden(batch.pixel_values[valid], capture=out if self.params.null_space else None)
        if self._refines:
            classes = torch.tensor(self.sequence.tasks[self.current_task].classes, device=hidden.device)
            onehot = batch.labels[valid].unsqueeze(1) == classes.unsqueeze(0)
            out["n"] = onehot.double().sum(0)
            out["feat_sum"], out["feat_outer"] = class_moments(onehot, hidden[:, 0], covariance=True)
        return out

    def finalize_statistics(self, reduced: dict[str, torch.Tensor], task: int) -> None:
        if self._refines:
            classes = list(self.sequence.tasks[task].classes)
            mean, cov = moments_to_gaussians(reduced["n"], reduced["feat_sum"], reduced["feat_outer"])
            self.feat_mean[classes] = mean.to(self.feat_mean)
            self.feat_cov[classes] = cov.to(self.feat_cov)
            self.seen[classes] = True
            self.refine_log = {"refine_loss": self.refine(task)}
        if self.params.null_space:
            self._null_spaces(reduced, task)

    def refine(self, task: int) -> float:
        """The official refine_head: retrain the projection on Gaussian samples of every seen class."""
        g = torch.Generator().manual_seed(1000003 * (task + 1))
        dev = self.feat_mean.device
        factors = gaussian_factors(self.feat_mean, self.feat_cov, torch.nonzero(self.seen).flatten().tolist())
        self.head.requires_grad_(True)
        groups = [{"params": [self.head.weight], "weight_decay": 1e-4}]  # timm: no weight decay on biases
        if self.head.bias is not None:
            groups.append({"params": [self.head.bias], "weight_decay": 0.0})
        opt = torch.optim.SGD(groups, lr=self.params.refine_lr, momentum=0.9, nesterov=True)  # timm's "sgd"
        allowed = self.seen.to(dev)
        loss = torch.zeros(())
        for _ in range(self.params.refine_epochs):
            x, y = sample_classes(factors, self.params.refine_samples, g)
            perm = torch.randperm(len(y), generator=g)
            x, y = x[perm].to(dev), y[perm].to(dev)
            for i in range(0, len(y), 256):
                with torch.enable_grad():
                    logits = self.classify(x[i:i + 256], train_scale=False).masked_fill(~allowed, float("-inf"))
                    loss = F.cross_entropy(logits, y[i:i + 256])
                    opt.zero_grad()
                    loss.backward()
                opt.step()
        self.head.requires_grad_(False)
        return float(loss.detach())

    def _null_spaces(self, reduced: dict[str, torch.Tensor], task: int) -> None:
        dims1, dims2 = [], []
        for i in range(len(self.layers)):
            self.cov1[i] += reduced[f"qk_{i}"].to(self.cov1)
            self.cov2[i] += reduced[f"sp_{i}"].to(self.cov2)
            p1, k1 = null_projection(self.cov1[i].cpu(), self.params.thres_mode, self.params.thres1, self.params.eta1)
            p2, k2 = null_projection(self.cov2[i].cpu(), self.params.thres_mode, self.params.thres2, self.params.eta2)
            if not self.params.project_qk:  # ablation: condition B1 not enforced
                p1, k1 = torch.eye(p1.shape[0], dtype=p1.dtype), 0
            if not self.params.project_sp:  # ablation: condition B2 not enforced
                p2, k2 = torch.eye(p2.shape[0], dtype=p2.dtype), 0
            self.proj1[i].copy_(p1)
            self.proj2[i].copy_(p2)
            dims1.append(k1)
            dims2.append(k2)
        self.tasks_projected.fill_(task + 1)
        self.null_dims = {"null_dims_qk": dims1, "null_dims_sp": dims2}

    def subspace_report(self) -> dict:
        return {**self.null_dims, **self.refine_log}
