"""``olora``: O-LoRA (Wang et al., EMNLP Findings 2023), orthogonal LoRA subspaces per task.

As the official code (cmnfriend/O-LoRA): every task trains a new rank-``r`` LoRA pair (``loranew_A/B``:
A kaiming-uniform, B zero) on the LLM's target projections while the pairs of earlier tasks stay frozen
(``lora_A/B``, their concatenation), both added with the same scaling ``alpha / r``; the loss adds
``lamda_1 * sum |A_old A_new^T|`` (entry-wise L1 of the products with every earlier task's A, summed over
modules) and ``lamda_2 * sum ||P||_2`` over the new pair's matrices (Frobenius norms, not squared); after
the task the new pair is concatenated onto the old (A on dim 0, B on dim 1). Defaults are the official
scripts': r 8, alpha 32, dropout 0.1, q_proj/v_proj (peft's LLaMA targets), lamda_1 0.5, lamda_2 0.

Here every task's pair exists from the build (a ``_TaskStack`` block per task, the later ones with B = 0,
so they add exactly nothing until trained) and only the current task's block is trainable: the
concatenation the official code builds by saving and reloading is the stack itself, and a rebuilt or
resumed method needs nothing but its state_dict. Numbers against the official code:
tests/reference/test_olora_reference.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import LossTerms
from mcit.methods.lora import LoRAFamily, LoRAFamilyParams


class OLoraParams(LoRAFamilyParams):
    alpha: float = Field(32.0, gt=0, description="scaling alpha / r of every task's pair (official scripts: 32)")
    dropout: float = Field(0.1, ge=0, lt=1, description="dropout on the adapters' input (official scripts: 0.1)")
    lamda_1: float = Field(0.5, ge=0, description="weight of the orthogonality term sum |A_old A_new^T| (the "
                                                  "official name and spelling)")
    lamda_2: float = Field(0.0, ge=0, description="weight of the L2 term: Frobenius norms of the new task's pair "
                                                  "(the official lamda_2)")


class _TaskStack(nn.Module):
    """One LoRA matrix of every task, concatenated along ``dim`` (0: A, rows; 1: B, columns): what peft's
    ``lora_A`` / ``lora_B`` slot computes with. ``weight`` is the concatenation (peft reads its dtype).

    The blocks are this module's own parameters and the regulariser terms of the current task's block are
    computed in its forward (kept in ``terms``), so under ZeRO-3 every block is read only while DeepSpeed
    has gathered it."""

    def __init__(self, blocks: list[torch.Tensor], dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()  # on A's input, as peft's slot
        for i, b in enumerate(blocks):
            self.register_parameter(f"task{i}", nn.Parameter(b))
        self.dim = dim
        self.task = 0
        self.terms: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def blocks(self) -> list[nn.Parameter]:
        return [getattr(self, f"task{i}") for i in range(len(self._parameters))]

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat(self.blocks, dim=self.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.blocks
        if torch.is_grad_enabled() and blocks[self.task].requires_grad:
            new = blocks[self.task]
            orth = new.new_zeros(())
            if self.dim == 0 and self.task > 0:  # A: |A_old A_new^T| over every earlier task's rows
                orth = torch.abs(torch.cat(blocks[: self.task], dim=0).detach() @ new.T).sum()
            self.terms = (orth, torch.norm(new, p=2))
        return F.linear(self.dropout(x), torch.cat(blocks, dim=self.dim))


@METHODS.register("olora")
class OLora(LoRAFamily):
    name = "olora"
    Params = OLoraParams

    def __init__(self, params: OLoraParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        self.set_task(0)

    def adapter_pair(self, m: nn.Module, kw: dict) -> tuple[nn.Module, nn.Module]:
        """Every task's pair for one layer: A kaiming-uniform (the official loranew_A init), B zero."""
        T, r = len(self.sequence), self.params.r
        a_blocks = [nn.init.kaiming_uniform_(torch.empty(r, m.in_features, **kw), a=math.sqrt(5)) for _ in range(T)]
        b_blocks = [torch.zeros(m.out_features, r, **kw) for _ in range(T)]
        return _TaskStack(a_blocks, 0, self.params.dropout), _TaskStack(b_blocks, 1)

    def set_task(self, task: int) -> None:
        """Only task ``task``'s pair trains; the earlier ones are the frozen ``lora_A/B``."""
        super().set_task(task)
        for m in self.adapters.values():
            for stack in (m["A"], m["B"]):
                stack.task = task
                for i, p in enumerate(stack.blocks):
                    p.requires_grad_(i == task)

    def trainable_parameters(self) -> list[nn.Parameter]:
        t = self.current_task
        return [p for m in self.adapters.values() for p in (m["A"].blocks[t], m["B"].blocks[t])] + \
            self.projector_parameters()

    def regularizer(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(orthogonal, l2) of the current task's pair, summed over modules as the official training_step
        does, from the terms each stack computed in this forward; None after a forward without gradients
        (the training-interference loss, which is the task loss alone)."""
        stacks = [s for m in self.adapters.values() for s in (m["A"], m["B"])]
        terms = [s.terms for s in stacks]
        for s in stacks:
            s.terms = None
        if any(t is None for t in terms):
            return None
        return sum(t[0] for t in terms), sum(t[1] for t in terms)

    def loss(self, batch: Batch, outputs: dict) -> LossTerms:
        terms = super().loss(batch, outputs)
        reg = self.regularizer()
        if reg is not None:
            orth, l2 = reg
            terms["regularizer"] = orth * self.params.lamda_1 + l2 * self.params.lamda_2
            terms.logs.update(orthogonal_loss=float(orth.detach()), l2_loss=float(l2.detach()))
        return terms

    @torch.no_grad()
    def overlap(self) -> float:
        """Sum over modules of |A_s A_t^T| between distinct tasks' trained blocks (for logs and tests)."""
        t = self.current_task
        total = 0.0
        for m in self.adapters.values():
            blocks = list(m["A"].blocks[: t + 1])
            for i in range(len(blocks)):
                for j in range(i):
                    total += float(torch.abs(blocks[j] @ blocks[i].T).sum())
        return total
