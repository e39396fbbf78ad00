"""DualPrompt (Wang et al., ECCV 2022), as in the paper and JH-LEE-KR/dualprompt-pytorch.

Prefix tuning (Pre-T) on a frozen ViT: a G(eneral)-prompt shared by all tasks on blocks
``g_layers`` (default 0-1, length 5) and an E(xpert)-prompt pool on blocks ``e_layers`` (default
2-4, length 5 for CIFAR, 20 for ImageNet-R). Each prompt is split into a key half and a value half
that are put before the block's own (projected) keys and values. Each E-prompt has a learnable key;
the query is the frozen model's [CLS] feature. Training task t uses its own E-prompt (the official
``use_prompt_mask``) and pulls that prompt's key to the queries (``pull_coeff`` 1.0); inference picks
the top-1 key per sample. The head reads the [CLS] output; other tasks' logits are masked in training.
At the start of task t > 0 its E-prompt is initialised from task t-1's (``shared_prompt_pool``).

Two deliberate differences from the public code, both correctness fixes:
  * the per-sample prefix is built with a permute (``mcit.methods.prompting.gather_prefix``); the
    public code's reshape mixes samples of a batch with each other (docs/architecture.md, "Known faults");
  * selection is per sample; the official default ``batchwise_prompt`` majority vote (test accuracy
    depends on the test batch size) is available only as the explicit ``batchwise_selection: true``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import LayerList, LossTerms, Method, MethodParams
from mcit.methods.prompting import (
    HEAD_INIT_DOC,
    HeadInit,
    classifier_head,
    cosine,
    gather_prefix,
    majority_vote,
    mask_to_classes,
    prefix_prompt,
    uniform_,
)


class DualPromptParams(MethodParams):
    g_prompt_length: int = Field(5, ge=0, description="0 disables the G-prompt")
    g_layers: LayerList = Field(default_factory=lambda: [0, 1],
                                description="blocks with the G-prompt (official --g_prompt_layer_idx)")
    e_prompt_length: int = Field(5, ge=1, description="E-prompt length (official --length): 5 for CIFAR, 20 for "
                                                      "ImageNet-R")
    e_layers: LayerList = Field(default_factory=lambda: [2, 3, 4],
                                description="blocks with the E-prompt pool (official --e_prompt_layer_idx)")
    pool_size: int | None = Field(None, ge=1, description="E-prompts; default: number of tasks x top_k")
    top_k: int = Field(1, ge=1, description="E-prompts per task in training and selected per sample at inference "
                                            "(official --top_k)")
    pull_coeff: float = Field(1.0, ge=0, description="weight of the key-query pull loss (official "
                                                     "--pull_constraint_coeff)")
    train_mask: bool = Field(True, description="mask the logits of classes outside the current task in training")
    shared_prompt_pool: bool = Field(True, description="initialise task t's E-prompt from task t-1's")
    shared_prompt_key: bool = Field(False, description="initialise task t's key from task t-1's")
    head_type: Literal["token", "gap"] = Field(
        "token", description="the head's input: the [CLS] output or the mean of the patch outputs")
    head_init: HeadInit = Field("timm", description=HEAD_INIT_DOC)
    batchwise_selection: bool = Field(
        False, description="official-code mode: one majority-voted prompt set per batch (batch-size dependent)")

    @model_validator(mode="after")
    def _disjoint(self) -> "DualPromptParams":
        both = set(self.g_layers) & set(self.e_layers) if self.g_prompt_length else set()
        if both:
            raise ValueError(f"g_layers and e_layers overlap at {sorted(both)}")
        return self

    def check_against(self, num_layers: int | None, num_tasks: int) -> None:
        super().check_against(num_layers, num_tasks)
        if self.pool_size is not None and self.pool_size < num_tasks * self.top_k:
            raise ValueError(f"method.pool_size ({self.pool_size}) is smaller than tasks x top_k "
                             f"({num_tasks} x {self.top_k}); every task needs its own E-prompt")


def task_prompt_ids(task: int, top_k: int, batch: int, device: torch.device) -> torch.Tensor:
    """The E-prompts task ``task`` trains (the official prompt mask), for every sample: (B, k)."""
    return torch.arange(task * top_k, (task + 1) * top_k, device=device).unsqueeze(0).expand(batch, -1)


@METHODS.register("dualprompt")
class DualPrompt(Method):
    name = "dualprompt"
    Params = DualPromptParams

    def __init__(self, params: DualPromptParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        p = params
        self.pool_size = p.pool_size or len(sequence) * p.top_k
        h, hd, d = backbone.num_heads, backbone.head_dim, backbone.hidden_size
        self.e_prompt = uniform_((len(p.e_layers), 2, self.pool_size, p.e_prompt_length, h, hd))
        self.e_key = uniform_((self.pool_size, d))
        if p.g_prompt_length:
            self.g_prompt = uniform_((len(p.g_layers), 2, p.g_prompt_length, h, hd))
        self.head = classifier_head(d, sequence.num_classes, params.head_init)

    def before_task(self, task: int) -> None:
        super().before_task(task)
        k = self.params.top_k
        if task == 0:
            return
        with torch.no_grad():
            if self.params.shared_prompt_pool:
                self.e_prompt[:, :, task * k:(task + 1) * k] = self.e_prompt[:, :, (task - 1) * k:task * k]
            if self.params.shared_prompt_key:
                self.e_key[task * k:(task + 1) * k] = self.e_key[(task - 1) * k:task * k]

    # -- forward -----------------------------------------------------------------------------------
    def layer_prompts(self, e_prefix: torch.Tensor, batch: int) -> dict:
        """Every prompted block's LayerPrompt from the per-sample E-prefix (layers, B, 2, P, H, hd)."""
        prompts = {layer: prefix_prompt(e_prefix[i]) for i, layer in enumerate(self.params.e_layers)}
        if self.params.g_prompt_length:
            for i, layer in enumerate(self.params.g_layers):
                prompts[layer] = prefix_prompt(self.g_prompt[i].unsqueeze(0).expand(batch, -1, -1, -1, -1))
        return prompts

    def features(self, pixel_values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The head's input with E-prompts ``idx`` (B, k)."""
        e_prefix = gather_prefix(self.e_prompt, idx)
        hidden = self.backbone.encode(self.backbone.embed(pixel_values), self.layer_prompts(e_prefix, idx.shape[0]))
        return hidden[:, 0] if self.params.head_type == "token" else hidden[:, 1:].mean(dim=1)

    def select(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k E-prompt ids per sample (B, k) and the cosine similarities to every key (B, M)."""
        sim = cosine(query, self.e_key)
        idx = sim.topk(self.params.top_k, dim=-1).indices
        if self.params.batchwise_selection:
            idx = majority_vote(idx, self.params.top_k, self.pool_size)
        return idx, sim

    def train_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        x = batch.pixel_values
        query = self.backbone.cls_features(x)
        sim = cosine(query, self.e_key)
        idx = task_prompt_ids(batch.task, self.params.top_k, x.shape[0], x.device)
        logits = self.head(self.features(x, idx).to(self.head.weight.dtype))
        return {"logits": logits, "selected_sim": sim.gather(1, idx).sum(dim=1)}

    def loss(self, batch: Batch, outputs: dict[str, torch.Tensor]) -> LossTerms:
        logits = outputs["logits"].float()
        if self.params.train_mask:
            logits = mask_to_classes(logits, self.sequence.tasks[batch.task].classes)
        ce = F.cross_entropy(logits, batch.labels, reduction="none")
        return LossTerms(per_sample=ce - self.params.pull_coeff * outputs["selected_sim"], task=ce,
                         logs={"pull_sim": float(outputs["selected_sim"].detach().mean())})

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        x = batch.pixel_values
        idx, _ = self.select(self.backbone.cls_features(x))
        logits = self.head(self.features(x, idx).to(self.head.weight.dtype))
        return self.restrict(logits, batch).argmax(dim=-1)
