"""``prompt_tuning``: sequential prompt tuning of a frozen MLLM with no protection (MCIT baseline).

One soft prompt of ``prompt_length`` vectors is prepended to every sample's input embeddings and
trained task after task with the answer-token loss (Lester et al. 2021 applied sequentially, the
"PT" baseline of the Fwd-Prompt paper). Nothing protects old tasks, so it shows the forgetting
that Fwd-Prompt's projection is meant to remove.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import MethodParams
from mcit.methods.instruction import InstructionMethod, init_from_vocab


class PromptTuningParams(MethodParams):
    prompt_length: int = Field(8, ge=1, description="soft prompt vectors prepended to every sample's input "
                                                    "embeddings")


@METHODS.register("prompt_tuning")
class PromptTuning(InstructionMethod):
    name = "prompt_tuning"
    Params = PromptTuningParams

    def __init__(self, params: PromptTuningParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        self._check_backbone()
        self.prompt = init_from_vocab(backbone, (params.prompt_length, backbone.hidden_size))

    def select_prompts(self, batch: Batch, embeds: torch.Tensor, image_query: torch.Tensor
                       ) -> tuple[torch.Tensor | None, dict[str, Any]]:
        return self.prompt.unsqueeze(0).expand(embeds.shape[0], -1, -1), {}
