"""``sefe``: SEFE's RegLoRA (Chen et al., ICML 2025, "SEFE: Superficial and Essential Forgetting Eliminator for
Multimodal Continual Instruction Tuning"), LoRA whose update is kept off the earlier tasks' key elements.

As the official code (jinpeng0528/SEFE 2f61efe; the same files in Ghy0501/MCITlib SEFE/):

* every task trains a fresh LoRA (peft's init: A kaiming-uniform, B zero) on every linear layer of the LLM
  (``find_all_linear_names``) of the model into which the earlier tasks' LoRAs were merged
  (``scripts/merge_lora_weights.py`` after each task, the next task's ``--model_name_or_path``);
* after a task, ``key_elements_identification.py`` takes, per adapted matrix, the ``int(0.02 * rows * cols)``
  entries of largest ``|B A|`` (the task's own LoRA product, without the ``alpha / r`` scaling) and
  concatenates their (row, col) indices with those of the earlier tasks (duplicates stay: they count twice);
* while training a later task, ``LlamaDecoderLayer.forward`` adds ``mean |(B A)[key elements]|`` of the
  current LoRA over the 7 projections of every layer, ``LlamaModel.forward`` divides the sum by 224 (32 layers x
  7 projections of Vicuna-7B) and ``LlavaLlamaForCausalLM.forward`` adds it times 2.5e3 to the LM loss.

Defaults are the official scripts' (``scripts/Train/*.sh`` and train.py's defaults): r 128, alpha 256,
dropout 0.05, all linear layers, the projector trained at ``--mm_projector_lr 2e-5`` (its own group in
``LLaVATrainer.create_optimizer``; the projector of the merged model goes on training task after task).

Here the merge is a stack, as O-LoRA's (a rebuilt or resumed method needs nothing but its state_dict, and the
frozen backbone stays untouched): every task's pair exists from the build, those of earlier tasks frozen (they
are the merged weights: they see the input without the LoRA dropout, as merged weights do), the current one
trained, later ones zero (B = 0) and not computed. The key elements are a function of the frozen pairs, so they
are recomputed (and cached) rather than stored: the same indices the official script writes, with no state
of their own. Numbers against the official code: tests/reference/test_sefe_reference.py.

The merge's precision, judged a defect of the official code and not reproduced: its merge loads the model in
float16 (``builder.py``: ``torch_dtype=torch.float16``), adds the pair in float16, saves float16, and the next task
trains on that checkpoint loaded in bfloat16 (``--bf16 True``). An update small next to the weight is rounded
away: on a 4096 x 4096 float16 projection (std 0.02) with a rank-16 update whose entries' std is 1% of the
weight's, the next task's bfloat16 weights hold the update with relative error 0.24 (cosine 0.973) and 18% of its
entries are lost; at 0.3%, error 0.73 and 44% lost; at 0.1%, 69% lost (``python bench/sefe_merge_precision.py``).
The stack adds the exact update, so the earlier tasks' learning reaches the later ones whole.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import LossTerms
from mcit.methods.lora import LoRAFamily, LoRAFamilyParams, Targets


class SefeParams(LoRAFamilyParams):
    r: int = Field(128, ge=1, description="LoRA rank of each task's pair (official scripts: 128)")
    alpha: float = Field(256.0, gt=0, description="scaling alpha / r of every task's pair (official scripts: 256)")
    # train.py's lora_dropout default (the scripts do not set it)
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the current task's LoRA input (train.py's "
                                                         "lora_dropout default)")
    target_modules: Targets = Field("all-linear", description="the LLM's modules to adapt: all-linear (official "
                                                              "find_all_linear_names) or module names")
    # llava_llama.py: loss = loss_reg * 2.5e3 + CE
    reg_weight: float = Field(2.5e3, ge=0, description="weight of the key-element regulariser in the loss "
                                                       "(llava_llama.py: 2.5e3)")
    # key_elements_identification.py: the top int(0.02 * rows * cols) entries of |B A| per matrix
    key_ratio: float = Field(0.02, gt=0, le=1, description="share of a matrix's entries, largest |B A| first, that "
                                                           "are a task's key elements (official: 0.02)")
    # modeling_llama.py: loss_reg / 224, the number of adapted matrices of Vicuna-7B (32 layers x 7 projections),
    # hard-coded whatever the model; null: the number of adapted matrices of this model (the same mean on 7B)
    reg_normalizer: Optional[float] = Field(224.0, gt=0, description="divisor of the regulariser's sum over adapted "
                                                                     "matrices (official: 224); null: their number")


def key_element_count(rows: int, cols: int, ratio: float) -> int:
    """How many key elements a rows x cols matrix has (the official expression, evaluated in its order)."""
    return int(ratio * rows * cols)


class _TaskLoRA(nn.Module):
    """peft's ``lora_A`` slot of one adapted matrix: every task's LoRA pair (``A{i}``: r x in, ``B{i}``: out x r),
    computing the whole update ``sum_{i <= task} B_i A_i x`` (peft's ``lora_B`` slot is the identity and peft
    multiplies by ``alpha / r``). Holding A and B together lets the regulariser, which needs both, be computed in
    this module's forward, where ZeRO-3 has gathered its parameters (kept in ``term`` for ``Sefe.loss``)."""

    def __init__(self, in_features: int, out_features: int, r: int, tasks: int, dropout: float, ratio: float,
                 **kw) -> None:
        super().__init__()
        for i in range(tasks):
            a = nn.Parameter(torch.empty(r, in_features, **kw))
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # peft's init_lora_weights=True
            self.register_parameter(f"A{i}", a)
            self.register_parameter(f"B{i}", nn.Parameter(torch.zeros(out_features, r, **kw)))
        self.tasks = tasks
        self.count = key_element_count(out_features, in_features, ratio)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.task = 0
        self.term: torch.Tensor | None = None
        self._keys: tuple[int, torch.Tensor] | None = None  # (task, flat indices of the earlier tasks' key elements)

    def a(self, i: int) -> nn.Parameter:
        return getattr(self, f"A{i}")

    def b(self, i: int) -> nn.Parameter:
        return getattr(self, f"B{i}")

    @property
    def weight(self) -> torch.Tensor:
        """What peft reads of ``lora_A`` (the dtype it casts the input to)."""
        return self.a(self.task)

    def delta(self, i: int) -> torch.Tensor:
        """Task ``i``'s unscaled update ``B_i A_i`` (what the official code ranks and regularises)."""
        return self.b(i) @ self.a(i)

    @torch.no_grad()
    def top(self, i: int) -> torch.Tensor:
        """Task ``i``'s key elements as flat indices into ``B_i A_i``, largest ``|.|`` first
        (key_elements_identification.py: ``torch.topk(|B @ A|.view(-1), k)``)."""
        return torch.topk(self.delta(i).float().abs().view(-1), self.count).indices

    def keys(self) -> torch.Tensor:
        """The key elements of every task before the current one, concatenated newest first as the official
        script concatenates each task's onto the earlier ones (cached per task)."""
        if self._keys is None or self._keys[0] != self.task:
            if self.task == 0:
                idx = torch.zeros(0, dtype=torch.long, device=self.a(0).device)
            else:
                idx = torch.cat([self.top(i) for i in reversed(range(self.task))])
            small = self.b(0).shape[0] * self.a(0).shape[1] < 2 ** 31  # int32 halves the memory of 7B's indices
            self._keys = (self.task, idx.to(torch.int32) if small else idx)
        return self._keys[1]

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._keys = None  # new frozen pairs: new key elements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.task
        a, b = self.a(t), self.b(t)
        out = F.linear(F.linear(self.dropout(x), a), b)
        if t > 0:  # the merged earlier tasks: no LoRA dropout on their input
            old_a = torch.cat([self.a(i) for i in range(t)], dim=0)
            old_b = torch.cat([self.b(i) for i in range(t)], dim=1)
            out = out + F.linear(F.linear(x, old_a), old_b)
        if t > 0 and torch.is_grad_enabled() and a.requires_grad:
            self.term = (b @ a).view(-1).index_select(0, self.keys().to(b.device)).abs().mean()
        return out


@METHODS.register("sefe")
class Sefe(LoRAFamily):
    name = "sefe"
    Params = SefeParams

    def __init__(self, params: SefeParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        small = [n for n, m in self.adapters.items() if m["A"].count == 0]
        if small:
            raise ValueError(f"method.key_ratio {params.key_ratio} leaves {small[0].replace('__', '.')} without key "
                             f"elements (int(key_ratio * rows * cols) = 0)")
        self.set_task(0)

    def adapter_pair(self, m: nn.Module, kw: dict) -> tuple[nn.Module, nn.Module]:
        p = self.params
        return _TaskLoRA(m.in_features, m.out_features, p.r, len(self.sequence), p.dropout, p.key_ratio, **kw), \
            nn.Identity()

    def stacks(self) -> dict[str, _TaskLoRA]:
        """Every adapted matrix's task stack, by module name (``layers.0.self_attn.q_proj``)."""
        return {n.replace("__", "."): m["A"] for n, m in self.adapters.items()}

    def set_task(self, task: int) -> None:
        """Only task ``task``'s pair trains; the earlier ones are the merged weights."""
        super().set_task(task)
        for s in self.stacks().values():
            s.task = task
            s.term = None
            for i in range(s.tasks):
                s.a(i).requires_grad_(i == task)
                s.b(i).requires_grad_(i == task)

    def before_task(self, task: int) -> None:
        """The earlier tasks' key elements are ready before the first step (the official script runs then)."""
        super().before_task(task)
        self.set_task(task)
        if task > 0:
            for s in self.stacks().values():
                s.keys()

    def trainable_parameters(self) -> list[nn.Parameter]:
        t = self.current_task
        return [p for s in self.stacks().values() for p in (s.a(t), s.b(t))] + self.projector_parameters()

    def key_elements(self) -> dict[str, torch.Tensor]:
        """The earlier tasks' key elements of every adapted matrix as (row, col) rows, in the official order."""
        out = {}
        for name, s in self.stacks().items():
            flat = s.keys().long()
            cols = s.a(0).shape[1]
            out[name] = torch.stack([flat // cols, flat % cols], dim=1)
        return out

    def regularizer(self) -> torch.Tensor | None:
        """``sum of mean |(B A)[key elements]| / reg_normalizer`` over the adapted matrices, from the terms their
        forwards computed (modeling_llama.py's loss_reg); None before a second task or without gradients."""
        stacks = list(self.stacks().values())
        terms = [s.term for s in stacks]
        for s in stacks:
            s.term = None
        if any(t is None for t in terms):
            return None
        norm = self.params.reg_normalizer if self.params.reg_normalizer is not None else len(terms)
        return sum(terms) / norm

    def loss(self, batch: Batch, outputs: dict) -> LossTerms:
        terms = super().loss(batch, outputs)
        reg = self.regularizer()
        if reg is not None:
            terms["regularizer"] = reg * self.params.reg_weight
            terms.logs["reg_loss"] = float(reg.detach())
        return terms
