"""CODA-Prompt (Smith et al., CVPR 2023), as in the paper and its official code (GT-RIPL/CODA-Prompt,
also ported in aimagelab/mammoth).

Per prompted block l (default 0-4): M prompt components P_l (M, L, D), keys K_l (M, D) and attention
vectors A_l (M, D). The query q is the frozen model's [CLS] feature. A component's weight is the
cosine similarity of the attended query q * A_m with its key K_m, and the block's prompt is
sum_m w_m P_m (B, L, D); its first L/2 tokens become the prefix keys and the rest the prefix values
(per head, after the block's projections, as in the official ViT). No selection and no top-k, so the
whole pipeline is differentiable end to end.

The M components are split evenly over the tasks. At the start of task t its M/T components are
(re)initialised orthonormal to all earlier ones (Gram-Schmidt, here by QR); earlier components are
used detached (frozen) and later ones not at all. Predictions after task t use components 0..t
(``tasks_seen`` is part of the state, so a checkpoint evaluated later uses exactly what it trained).
Loss: cross-entropy over the current task's classes, plus ``ortho_mu`` times the orthogonality penalty
of the official code (0 by default, as in its configs). The head reads the [CLS] output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import LayerList, LossTerms, Method, MethodParams
from mcit.methods.prompting import mask_to_classes, per_head
from mcit.models.base import LayerPrompt


class CodaPromptParams(MethodParams):
    pool_size: int = Field(100, ge=1, description="components per block, split evenly over the tasks")
    prompt_length: int = Field(8, ge=2, description="even: half prefix keys, half prefix values")
    layers: LayerList = Field(default_factory=lambda: [0, 1, 2, 3, 4], description="prompted blocks (prefix tuning)")
    ortho_mu: float = Field(0.0, ge=0, description="weight of the official orthogonality penalty (0: off, as its "
                                                   "configs)")
    train_mask: bool = Field(True, description="mask the logits of classes outside the current task in training")

    @model_validator(mode="after")
    def _even_length(self) -> "CodaPromptParams":
        if self.prompt_length % 2:
            raise ValueError(f"prompt_length must be even (half keys, half values), got {self.prompt_length}")
        return self

    def check_against(self, num_layers: int | None, num_tasks: int) -> None:
        super().check_against(num_layers, num_tasks)
        if self.pool_size % num_tasks:
            raise ValueError(f"method.pool_size ({self.pool_size}) must divide evenly over the {num_tasks} tasks")


def orthonormal_extend(old: torch.Tensor, n_new: int, generator: torch.Generator) -> torch.Tensor:
    """``n_new`` random unit vectors orthogonal to each other and to the rows of ``old`` (m, d)."""
    d = old.shape[1]
    if old.shape[0] + n_new > d:
        raise ValueError(f"CODA-Prompt: {old.shape[0] + n_new} orthogonal components do not fit in {d} dimensions; "
                         f"lower method.pool_size")
    v = torch.randn(n_new, d, generator=generator, dtype=torch.float64)
    if old.shape[0]:
        q_old, _ = torch.linalg.qr(old.double().t())
        v = v - (v @ q_old) @ q_old.t()
        v = v - (v @ q_old) @ q_old.t()  # twice: round-off
    q, _ = torch.linalg.qr(v.t())
    return q.t().to(old.dtype)


@METHODS.register("coda_prompt")
class CodaPrompt(Method):
    name = "coda_prompt"
    Params = CodaPromptParams

    def __init__(self, params: CodaPromptParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        p, d = params, backbone.hidden_size
        n = len(p.layers)
        self.per_task = p.pool_size // len(sequence)
        self.prompt = nn.Parameter(torch.zeros(n, p.pool_size, p.prompt_length, d))
        self.key = nn.Parameter(torch.zeros(n, p.pool_size, d))
        self.attn = nn.Parameter(torch.zeros(n, p.pool_size, d))
        self.head = nn.Linear(d, sequence.num_classes)
        self.register_buffer("init_seed", torch.randint(0, 2**31 - 1, ()))
        self.register_buffer("tasks_seen", torch.zeros((), dtype=torch.long))
        self._init_components(0)

    def _init_components(self, task: int) -> None:
        """Gram-Schmidt initialisation of task ``task``'s components (same on every rank: seeded)."""
        s, f = task * self.per_task, (task + 1) * self.per_task
        g = torch.Generator().manual_seed(int(self.init_seed) + 7919 * task)
        with torch.no_grad():
            for tensor in (self.prompt, self.key, self.attn):
                for layer in range(tensor.shape[0]):
                    flat = tensor[layer].reshape(tensor.shape[1], -1)
                    new = orthonormal_extend(flat[:s].detach().cpu(), f - s, g)
                    tensor[layer, s:f] = new.reshape(tensor[layer, s:f].shape).to(tensor.device, tensor.dtype)

    def before_task(self, task: int) -> None:
        super().before_task(task)
        if task > 0:
            self._init_components(task)

    def after_task(self, task: int) -> None:
        self.tasks_seen.fill_(task + 1)

    # -- forward -----------------------------------------------------------------------------------
    def _components(self, tensor: torch.Tensor, layer: int, train_task: int | None) -> torch.Tensor:
        if train_task is None:  # inference: every component trained so far
            return tensor[layer, : max(int(self.tasks_seen), 1) * self.per_task]
        s, f = train_task * self.per_task, (train_task + 1) * self.per_task
        return torch.cat([tensor[layer, :s].detach(), tensor[layer, s:f]], dim=0)

    def layer_prompts(self, query: torch.Tensor, train_task: int | None) -> dict[int, LayerPrompt]:
        h = self.backbone.num_heads
        half = self.params.prompt_length // 2
        out = {}
        for i, layer in enumerate(self.params.layers):
            K = self._components(self.key, i, train_task)
            A = self._components(self.attn, i, train_task)
            P = self._components(self.prompt, i, train_task)
            aq = F.normalize(torch.einsum("bd,kd->bkd", query, A), dim=2)
            w = torch.einsum("bkd,kd->bk", aq, F.normalize(K, dim=1))
            prompt = torch.einsum("bk,kld->bld", w, P)
            out[layer] = LayerPrompt(key=per_head(prompt[:, :half], h), value=per_head(prompt[:, half:], h))
        return out

    def logits(self, pixel_values: torch.Tensor, train_task: int | None) -> torch.Tensor:
        """Logits with task ``train_task``'s components trainable and earlier ones frozen; None: inference with
        every component trained so far."""
        query = self.backbone.cls_features(pixel_values).to(self.key.dtype)
        hidden = self.backbone.encode(self.backbone.embed(pixel_values), self.layer_prompts(query, train_task))
        return self.head(hidden[:, 0].to(self.head.weight.dtype))

    def train_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"logits": self.logits(batch.pixel_values, batch.task)}

    def ortho_penalty(self, task: int) -> torch.Tensor:
        """The official penalty: mean squared deviation from the identity of each of K, A, P's Gram matrices
        over components 0..task (the older ones detached), summed over blocks (times ``ortho_mu`` in the loss)."""
        total = self.key.new_zeros(())
        for i in range(len(self.params.layers)):
            for tensor in (self.key, self.attn, self.prompt):
                t = self._components(tensor, i, task).reshape((task + 1) * self.per_task, -1)
                total = total + ((t @ t.t() - torch.eye(t.shape[0], device=t.device, dtype=t.dtype)) ** 2).mean()
        return total

    def loss(self, batch: Batch, outputs: dict[str, torch.Tensor]) -> LossTerms:
        logits = outputs["logits"].float()
        if self.params.train_mask:
            logits = mask_to_classes(logits, self.sequence.tasks[batch.task].classes)
        ce = F.cross_entropy(logits, batch.labels, reduction="none")
        reg = self.params.ortho_mu * self.ortho_penalty(batch.task) if self.params.ortho_mu > 0 else None
        return LossTerms(per_sample=ce, regularizer=reg)

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        return self.restrict(self.logits(batch.pixel_values, None), batch).argmax(dim=-1)
