"""``moelora``: MoELoRA, CoIN's own method (Chen et al., "CoIN", NeurIPS 2024 D&B), trained task after task.

As the official code (zackschen/CoIN, ``CoIN/peft/tuners/coinmoelora.py``): each target linear layer of
the LLM gets ``experts`` LoRA experts of rank ``r / experts`` (A_i normal(0, 0.01), B_i zero) and a
router (a bias-free linear layer, default init) whose softmax over experts weighs each token's expert
outputs: ``y = W x + sum_i softmax(R x)_i * B_i A_i dropout(x) * alpha / r``. The router reads ``x`` before
the dropout, the experts after it. Router, A and B all train on every task, each task starting from the
previous task's state (CoIN's ``--previous_task_model_path``). Defaults are CoIN's LLaVA scripts: r 128,
alpha 256, 8 experts, dropout 0.05, every linear layer of the LLM (``find_all_linear_names``).

Here the router and the experts sit in peft's ``lora_A`` slot (its dropout slot is the identity, so the
router sees the raw input; the experts' dropout is the method's own, so it follows the method's train /
eval mode) and B in ``lora_B``, the experts stacked: ``A`` holds expert i in rows
``i*r/E .. (i+1)*r/E`` and ``B`` in the same columns. Like every method here it leaves the multimodal
projector frozen (CoIN also tunes it at 2e-5). Numbers against the official code:
tests/reference/test_moelora_reference.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from mcit.core.registry import METHODS
from mcit.methods.lora import LoRAFamily, LoRAFamilyParams, Targets


class MoeLoraParams(LoRAFamilyParams):
    r: int = Field(128, ge=1, description="the experts' total rank per layer; each expert has rank r / experts "
                                          "(CoIN: 128)")
    alpha: float = Field(256.0, gt=0, description="scaling alpha / r of the routed experts' sum (CoIN: 256)")
    experts: int = Field(8, ge=1, description="LoRA experts per adapted layer (CoIN: 8)")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the experts' input; the router reads the input "
                                                         "before it (CoIN: 0.05)")
    target_modules: Targets = Field("all-linear", description="the LLM's modules to adapt: all-linear (CoIN's "
                                                              "find_all_linear_names) or module names")

    @model_validator(mode="after")
    def _rank_splits(self) -> "MoeLoraParams":
        if self.r % self.experts:
            raise ValueError(f"method: r ({self.r}) must divide evenly over experts ({self.experts})")
        return self


class RoutedExperts(nn.Module):
    """peft's ``lora_A`` slot of MoELoRA: the experts' A outputs, each expert's block scaled by its router
    weight, so that peft's ``lora_B(...)`` sums the routed experts."""

    def __init__(self, in_features: int, r: int, experts: int, dropout: float, **kw) -> None:
        super().__init__()
        self.experts = experts
        self.router = nn.Parameter(torch.empty(experts, in_features, **kw))
        nn.init.kaiming_uniform_(self.router, a=math.sqrt(5))  # nn.Linear's default, as the official router
        self.A = nn.Parameter(torch.empty(r, in_features, **kw).normal_(0.0, 0.01))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def weight(self) -> torch.Tensor:
        return self.A

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """(..., E) router weights, from the input before dropout."""
        return torch.softmax(F.linear(x, self.router), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate(x)
        h = F.linear(self.dropout(x), self.A)  # (..., r)
        return h * gate.repeat_interleave(h.shape[-1] // self.experts, dim=-1)


@METHODS.register("moelora")
class MoeLora(LoRAFamily):
    """peft's dropout slot is the identity (``lora_layers``): the router reads the input before the experts'
    dropout, which lives in ``RoutedExperts``."""

    name = "moelora"
    Params = MoeLoraParams

    def adapter_pair(self, m: nn.Module, kw: dict) -> tuple[nn.Module, nn.Module]:
        p = self.params
        a = RoutedExperts(m.in_features, p.r, p.experts, p.dropout, **kw)
        b = nn.Linear(p.r, m.out_features, bias=False, **kw)
        nn.init.zeros_(b.weight)
        return a, b
