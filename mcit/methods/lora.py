"""``lora``: sequential LoRA of the frozen MLLM's language model (peft), an MCIT baseline.

peft's ``inject_adapter_in_model`` adds LoRA layers to the LLM's attention projections in place; the
method registers the adapter matrices as its own submodules, so DeepSpeed trains, shards and
checkpoints exactly those (the backbone stays frozen and outside the engine). The LoRA layers are
injected once per backbone object; every build of the method puts *new* A/B Linear modules into them
(initialised as peft does), so a rebuilt method (after each stage, or on resume) starts from the same
values, loads its saved state, and shares no parameter object, hook or ZeRO bookkeeping with the
DeepSpeed engine of an earlier task (re-using them made a later task read stale optimizer state).
"""

from __future__ import annotations

import math

import torch
from pydantic import Field
from torch import nn

from mcit.data.types import TaskSequence
from mcit.methods.base import MethodParams
from mcit.methods.instruction import InstructionMethod
from mcit.registry import METHODS


class LoraParams(MethodParams):
    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"])


@METHODS.register("lora")
class Lora(InstructionMethod):
    name = "lora"
    Params = LoraParams

    def __init__(self, params: LoraParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        self._check_backbone()
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer

        lm = backbone.language_model
        if not any(isinstance(m, LoraLayer) for m in lm.modules()):
            cfg = LoraConfig(r=params.r, lora_alpha=params.alpha, lora_dropout=params.dropout,
                             target_modules=list(params.target_modules), bias="none")
            inject_adapter_in_model(cfg, lm)
        self.adapters = nn.ModuleDict()
        for name, m in lm.named_modules():
            if isinstance(m, LoraLayer) and "default" in m.lora_A:
                old_a, old_b = m.lora_A["default"], m.lora_B["default"]
                kw = {"device": old_a.weight.device, "dtype": torch.float32}
                a = nn.Linear(old_a.in_features, old_a.out_features, bias=False, **kw)
                b = nn.Linear(old_b.in_features, old_b.out_features, bias=False, **kw)
                nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))  # peft's own initialisation
                nn.init.zeros_(b.weight)
                m.lora_A["default"], m.lora_B["default"] = a, b
                self.adapters[name.replace(".", "__")] = nn.ModuleDict({"A": a, "B": b})
        if not len(self.adapters):
            raise ValueError(f"method.target_modules {params.target_modules} matched no module of the language model")

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.adapters.parameters()]

    @torch.no_grad()
    def merged_delta_norm(self) -> float:
        """Frobenius norm of all B @ A (for logs and tests)."""
        return float(sum((m["B"].weight @ m["A"].weight).norm() ** 2 for m in self.adapters.values()) ** 0.5)
