"""``seq``: sequential prompt tuning with no protection, the lower bound of the CIL table.

One prompt and one linear head are trained task after task with plain cross-entropy over all
classes: nothing keeps old classes' logits competitive, so the method forgets (catastrophic
forgetting in its clearest form). Same backbone, prompt shape and head as L2P for a fair comparison.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import LossTerms, Method, MethodParams
from mcit.methods.prompting import HEAD_INIT_DOC, HeadInit, classifier_head, insert_prompts, pool, uniform_


class SeqParams(MethodParams):
    prompt_length: int = Field(5, ge=1, description="tokens of the one prompt, inserted between [CLS] and the "
                                                    "patch tokens")
    head_type: Literal["prompt", "token", "token+prompt"] = Field(
        "prompt", description="the head's input: mean of the prompt outputs, the [CLS] output, or the mean of both")
    head_init: HeadInit = Field("timm", description=HEAD_INIT_DOC)


@METHODS.register("seq")
class Seq(Method):
    name = "seq"
    Params = SeqParams

    def __init__(self, params: SeqParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        self.prompt = uniform_((params.prompt_length, backbone.hidden_size))
        self.head = classifier_head(backbone.hidden_size, sequence.num_classes, params.head_init)

    def _logits(self, pixel_values: torch.Tensor) -> torch.Tensor:
        prompts = self.prompt.unsqueeze(0).expand(pixel_values.shape[0], -1, -1)
        hidden = insert_prompts(self.backbone, pixel_values, prompts)
        return self.head(pool(hidden, self.params.prompt_length, self.params.head_type).to(self.head.weight.dtype))

    def train_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"logits": self._logits(batch.pixel_values)}

    def loss(self, batch: Batch, outputs: dict[str, torch.Tensor]) -> LossTerms:
        ce = F.cross_entropy(outputs["logits"].float(), batch.labels, reduction="none")
        return LossTerms(per_sample=ce)

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        return self.restrict(self._logits(batch.pixel_values), batch).argmax(dim=-1)
