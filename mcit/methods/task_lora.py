"""The machinery of the MCIT methods that keep one LoRA pair per task in every adapted layer of the LLM and route
samples to tasks with a CLIP auxiliary backbone (HiDe-LLaVA, DISCO): their parameters, the per-task blocks in
peft's slots, which task trains, and the CLIP the pipeline resolves for them. What each computes from the blocks
(fusion, routing) stays in its own file."""

from __future__ import annotations

import abc
from contextlib import contextmanager
from typing import Iterator, Mapping

import torch
from pydantic import Field
from torch import nn

from mcit.data.types import TaskSequence
from mcit.methods.base import AuxiliaryBackbone, auxiliary_of
from mcit.methods.lora import LoRAFamily, LoRAFamilyParams, Targets


class TaskLoRAParams(LoRAFamilyParams):
    """MCITlib's UCIT defaults (lora_r 96 over the tasks, alpha 2 r, dropout 0.05, every linear layer) and the CLIP
    checkpoint the routing reads (official: LLaVA-1.5's vision tower checkpoint, openai/clip-vit-large-patch14-336)."""

    r: int = Field(96, ge=1, description="the total rank (official lora_r); each task's pair has rank r / tasks")
    alpha: float = Field(192.0, gt=0, description="scaling alpha / r (the scripts: lora_alpha = 2 lora_r)")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the adapters' input (LLaVA's default: 0.05)")
    target_modules: Targets = Field("all-linear", description="the LLM's modules to adapt: all-linear (official "
                                                              "find_all_linear_names) or module names")
    clip_path: str = Field(..., description="the CLIP checkpoint the routing reads: an HF directory, or the original "
                                            "file for a zoo clip_tag", json_schema_extra={"input_path": True})
    clip_tag: str = Field("local", description="backbone zoo tag of clip_path, or a label for an HF directory; "
                                              "recorded with its sha256 in backbone.json")
    clip_tokenizer: str | None = Field(None, description="clip_path an OpenAI file: a directory with its tokenizer",
                                       json_schema_extra={"input_path": True})

    def check_against(self, num_layers: int | None, num_tasks: int) -> None:
        super().check_against(num_layers, num_tasks)
        if self.r % num_tasks:
            raise ValueError(f"method.r: {self.r} does not split over the {num_tasks} tasks (each task's LoRA pair "
                             f"has rank r / tasks, as the official lora_r over expert_num)")


class TaskBlocks(nn.Module):
    """Every task's block of one peft slot as parameters ``task{i}`` (A: (r/T, in), B: (out, r/T))."""

    def __init__(self, blocks: list[torch.Tensor]) -> None:
        super().__init__()
        for i, b in enumerate(blocks):
            self.register_parameter(f"task{i}", nn.Parameter(b))

    @property
    def blocks(self) -> list[nn.Parameter]:
        return [getattr(self, f"task{i}") for i in range(len(self._parameters))]


class TaskLoRA(LoRAFamily, abc.ABC):
    """One pair per task (A normal(0, 0.01), B zero: the official reset_lora_parameters); task ``t`` trains its own
    (the official optimizer holds every pair, only ``t``'s is used); ``clip`` is the auxiliary CLIP (frozen, by
    reference: not in the state dict); the subspace stage computes the routing statistics."""

    has_subspace_stage = True
    params: TaskLoRAParams

    @classmethod
    def auxiliary_backbones(cls, params: TaskLoRAParams) -> dict[str, AuxiliaryBackbone]:
        return {"clip": AuxiliaryBackbone("clip", params.clip_path, params.clip_tag, params.clip_tokenizer,
                                          key="method.clip_path")}

    def __init__(self, params: TaskLoRAParams, backbone: nn.Module, sequence: TaskSequence, *,
                 auxiliary: Mapping[str, nn.Module] | None = None) -> None:
        clip = auxiliary_of(auxiliary, "clip", self.name)
        super().__init__(params, backbone, sequence)
        object.__setattr__(self, "clip", clip)

    @abc.abstractmethod
    def task_slots(self, a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[nn.Module, nn.Module]:
        """The method's (A, B) slot modules over the tasks' initial blocks."""

    @abc.abstractmethod
    def set_adapter_mode(self, mode: str, weights: torch.Tensor | None = None) -> None:
        """What the adapters compute in the next LLM forward: ``train`` (the current task's pair), ``infer``
        (routed by ``weights`` (B, T)) or ``off`` (nothing)."""

    def adapter_pair(self, m: nn.Module, kw: dict) -> tuple[nn.Module, nn.Module]:
        T = len(self.sequence)
        k = self.params.r // T
        a = [torch.empty(k, m.in_features, **kw).normal_(0.0, 0.01) for _ in range(T)]
        b = [torch.zeros(m.out_features, k, **kw) for _ in range(T)]
        return self.task_slots(a, b)

    def set_task(self, task: int) -> None:
        super().set_task(task)
        for m in self.adapters.values():
            for slot in (m["A"], m["B"]):
                for i, p in enumerate(slot.blocks):
                    p.requires_grad_(i == task)
        self.set_adapter_mode("train")

    def trainable_parameters(self) -> list[nn.Parameter]:
        t = self.current_task
        return [p for m in self.adapters.values() for p in (m["A"].blocks[t], m["B"].blocks[t])] + \
            self.projector_parameters()

    @contextmanager
    def zero_shot(self) -> Iterator[None]:
        """The pre-trained MLLM: the adapters add nothing."""
        with super().zero_shot():
            self.set_adapter_mode("off")
            try:
                yield
            finally:
                self.set_adapter_mode("train")
