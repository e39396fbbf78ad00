"""NoRGa (Le et al., NeurIPS 2024, "Mixture of Experts Meets Prompt-Based Continual Learning"), as
in the paper and Minhchuyentoancbn/MoE_PromptCL.

HiDe-Prompt (TII, prompt momentum, contrastive regulariser, task-adaptive prediction) with one
change in the prompted blocks: the scores of the prefix keys go through a non-linear residual gate,
s_hat = s + alpha * act(tau * s), with alpha and tau learnable per prompted block (initialised to 1,
as the official scripts) and ``activation`` sigmoid (default), tanh or GELU; the gated prefix scores
and the block's own (pre-trained) scores share one softmax. The official NoRGa_Attention computes
exactly this (``prompt_attn + gate_act(prompt_attn * act_scale[0]) * act_scale[1]``).
``gate: false`` is the paper's "without the gate" ablation: plain prefix scores (HiDe-Prompt's), and
alpha, tau are neither used nor trained. As in the official engine (``act_scale.requires_grad_(False)``
from task 1 on) alpha and tau are trained with the first task's prompt only and then shared, frozen, by
every task; ``gate_trainable: all_tasks`` keeps training them (a gate that drifts under old tasks).
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import TaskSequence
from mcit.methods.hide_prompt import HiDePrompt, HiDePromptParams

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "gelu": F.gelu}


class NoRGaParams(HiDePromptParams):
    activation: Literal["sigmoid", "tanh", "gelu"] = Field(
        "sigmoid", description="the gate's act in s + alpha * act(tau * s) on the prefix scores")
    tau_init: float = Field(1.0, description="initial tau of the gate, per prompted block (official 1)")
    alpha_init: float = Field(1.0, description="initial alpha of the gate, per prompted block (official 1)")
    gate: bool = Field(True, description="gate the prefix scores; false: plain prefix scores (the paper's "
                                         "\"without the gate\" ablation)")
    gate_trainable: Literal["first_task", "all_tasks"] = Field(
        "first_task", description="train alpha and tau with the first task only, then frozen (the official "
                                  "engine), or on every task")
    ca_storage: Literal["multi-centroid", "covariance", "variance"] = Field(
        "covariance", description="every NoRGa script passes --ca_storage_efficient_method covariance")


@METHODS.register("norga")
class NoRGa(HiDePrompt):
    name = "norga"
    Params = NoRGaParams

    def __init__(self, params: NoRGaParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        n = len(params.e_layers)
        self.gate_tau = nn.Parameter(torch.full((n,), params.tau_init))
        self.gate_alpha = nn.Parameter(torch.full((n,), params.alpha_init), requires_grad=params.gate)
        self.gate_tau.requires_grad_(params.gate)

    def before_task(self, task: int) -> None:
        super().before_task(task)
        train = self.params.gate and (task == 0 or self.params.gate_trainable == "all_tasks")
        self.gate_tau.requires_grad_(train)
        self.gate_alpha.requires_grad_(train)

    def param_groups(self) -> list[dict]:
        groups = super().param_groups()
        groups[0]["params"] = [self.e_prompt, self.gate_tau, self.gate_alpha] if self.params.gate else [self.e_prompt]
        return groups

    def gate(self, layer_index: int) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
        if not self.params.gate:
            return None
        act = ACTIVATIONS[self.params.activation]
        tau, alpha = self.gate_tau[layer_index], self.gate_alpha[layer_index]

        def score_fn(scores: torch.Tensor, n_prefix: int) -> torch.Tensor:
            s = scores[..., :n_prefix]
            gated = s + alpha.to(s.dtype) * act(tau.to(s.dtype) * s)
            return torch.cat([gated, scores[..., n_prefix:]], dim=-1)

        return score_fn
