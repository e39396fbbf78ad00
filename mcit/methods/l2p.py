"""L2P (Wang et al., "Learning to Prompt for Continual Learning", CVPR 2022).

As in the paper and JH-LEE-KR/l2p-pytorch: a pool of ``pool_size`` prompts of length
``prompt_length``, each with a learnable key; the query is the frozen pre-trained [CLS] feature;
the ``top_k`` keys with the highest cosine similarity select the prompts, which are inserted between
[CLS] and the patch tokens, each with the [CLS] token's position embedding added (the official code
repeats the [CLS] entry of its position table over the prompt slots; ``prompt_position: none`` leaves
it out, a fixed offset of the prompts' starting point); the head reads the mean of the prompt
outputs; the loss is cross-entropy with the logits of classes outside the current task masked out,
minus ``pull_coeff`` times the summed query-key similarity of the selected keys (the surrogate loss
that pulls keys to their queries).

Selection is per sample. The official code's default selects one set of prompts for the whole batch
by majority vote (``batchwise_prompt``), which makes test accuracy depend on the test batch size and
on how test loaders are grouped; that mode exists here only as the explicit
``batchwise_selection: true``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import LossTerms, Method, MethodParams
from mcit.methods.prompting import (
    HEAD_INIT_DOC,
    HeadInit,
    classifier_head,
    insert_prompts,
    majority_vote,
    mask_to_classes,
    pool,
    uniform_,
)


class L2PParams(MethodParams):
    pool_size: int = Field(10, ge=1, description="prompts in the pool, each with a learnable key (L2P's --size 10)")
    prompt_length: int = Field(5, ge=1, description="tokens per prompt (L2P's --length 5)")
    top_k: int = Field(5, ge=1, description="prompts selected per sample by key-query cosine similarity (L2P's "
                                            "--top_k 5)")
    pull_coeff: float = Field(0.1, ge=0, description="weight of the key-query pull (surrogate) loss")
    train_mask: bool = Field(True, description="mask the logits of classes outside the current task in training")
    head_type: Literal["prompt", "token", "token+prompt"] = Field(
        "prompt", description="the head's input: mean of the prompt outputs, the [CLS] output, or the mean of "
                              "both (L2P's --head_type)")
    head_init: HeadInit = Field("timm", description=HEAD_INIT_DOC)
    prompt_position: Literal["cls", "none"] = Field(
        "cls", description="position embedding of the prompt tokens: the [CLS] one (the official code) or none")
    batchwise_selection: bool = Field(
        False, description="official-code mode: one majority-voted prompt set per batch (batch-size dependent)"
    )

    @model_validator(mode="after")
    def _top_k_fits(self) -> "L2PParams":
        if self.top_k > self.pool_size:
            raise ValueError(f"top_k ({self.top_k}) exceeds pool_size ({self.pool_size})")
        return self


@METHODS.register("l2p")
class L2P(Method):
    name = "l2p"
    Params = L2PParams

    def __init__(self, params: L2PParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        d = backbone.hidden_size
        self.prompt = uniform_((params.pool_size, params.prompt_length, d))
        self.prompt_key = uniform_((params.pool_size, d))
        self.head = classifier_head(d, sequence.num_classes, params.head_init)

    def select(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k prompt indices (B, k) and the cosine similarities to all keys (B, M)."""
        sim = F.normalize(query.float(), dim=-1) @ F.normalize(self.prompt_key.float(), dim=-1).t()
        idx = sim.topk(self.params.top_k, dim=-1).indices
        if self.params.batchwise_selection:
            idx = majority_vote(idx, self.params.top_k, self.params.pool_size)
        return idx, sim

    def prompted(self, pixel_values: torch.Tensor, query: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Logits and selection of the forward with each sample's selected prompts (query: frozen [CLS])."""
        query = self.backbone.cls_features(pixel_values) if query is None else query
        idx, sim = self.select(query)
        b = pixel_values.shape[0]
        prompts = self.prompt[idx].reshape(b, self.params.top_k * self.params.prompt_length, -1)
        hidden = insert_prompts(self.backbone, pixel_values, prompts, self.params.prompt_position)
        feats = pool(hidden, prompts.shape[1], self.params.head_type)
        logits = self.head(feats.to(self.head.weight.dtype))
        return {"logits": logits, "selected_sim": sim.gather(1, idx).sum(dim=1), "idx": idx}

    def train_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.prompted(batch.pixel_values)

    def loss(self, batch: Batch, outputs: dict[str, torch.Tensor]) -> LossTerms:
        logits = outputs["logits"].float()
        if self.params.train_mask:
            logits = mask_to_classes(logits, self.sequence.tasks[batch.task].classes)
        ce = F.cross_entropy(logits, batch.labels, reduction="none")
        per_sample = ce - self.params.pull_coeff * outputs["selected_sim"]
        pull = float(outputs["selected_sim"].detach().mean())
        return LossTerms(per_sample=per_sample, task=ce, logs={"pull_sim": pull})

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        return self.restrict(self.prompted(batch.pixel_values)["logits"], batch).argmax(dim=-1)
