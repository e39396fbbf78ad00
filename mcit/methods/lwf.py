"""``lwf``: Learning without Forgetting (Li & Hoiem, TPAMI 2017) on sequential LoRA, as Continual-NExT runs it.

The official code (ECNU-SII/Continual-NExT bf813e4, an ms-swift fork; ``swift/trainers/cl/lwf/lwf_pre.py``: ``LWF``,
``swift/trainers/trainers.py``: ``Seq2SeqTrainer.__init__``, ``compute_loss``, ``ContinualLearningLWF``):

* **Teacher.** The model as the task starts: the previous task's adapters (``--resume_from_checkpoint`` of the
  previous task, ``--resume_only_model``), in eval mode (``LWF.__init__``); none in the first task (the scripts
  pass ``--use_lwf False`` there). Its logits on the task's training data are computed once before training
  (``precompute_logits``, unshuffled batches of the training batch size) and cached per sample.
* **Term.** ``kl_div(log_softmax(student / T), softmax(teacher / T), reduction="batchmean") * T^2`` over the
  (B, L, V) logits (``lwf_loss_with_cached_logits``): the KL summed over the vocabulary and every position, divided
  by the batch size -- per sample, the KL summed over its positions. Added to the step's loss times ``alpha``.
  ``T = 2.0`` and ``alpha = 0.001`` are hard-coded in the trainer (the LWF class's own ``alpha`` is unused;
  assets/methods/LWF.md says 0.0001).
* The base learner is the one LoRA that every task keeps training (ms-swift's defaults: alpha 32, dropout 0.05,
  all-linear, the projector frozen; the scripts: ``--lora_rank 64``): this file's defaults.

Here the teacher is a frozen copy of the adapters (and of the projector where it trains), taken in ``before_task``
of every task after the first and kept in the method's state (``teacher.*``, ``teacher_task``), so a rebuilt or
resumed method distils from the same model. Its logits are computed in each step under ``no_grad`` (the teacher's
modules put into peft's LoRA slots for that forward) instead of cached for the whole task: the same numbers (a
fixed teacher without dropout on the same inputs), without a (samples x length x vocabulary) cache.
Numbers against the official code: tests/reference/test_lwf_reference.py.

Known fault of the official code: the cache keeps every position of each sample's padded row (``valid_logits =
sample_logits`` despite "only caches the valid tokens (non-padding)"), so the KL also runs over the batch's padding
positions and a sample's term depends on how much its batch pads it. Here the positions are a sample's own
(``kl_positions: all``: every position the attention mask keeps -- image tokens, prompt and answer; with no padding
this is the official sum). ``kl_positions: answer`` keeps only the answer tokens' own positions (the mask of the
official fallback ``LWF.lwf_loss``, ``labels != -100``, unshifted as there), still summed per sample. The Qwen
scripts' ``--use_logits_to_keep`` narrows the official sum to a window from the batch's earliest answer token: a
memory device whose positions depend on the batch, not followed.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Iterator, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import LossTerms
from mcit.methods.instruction import lm_outputs
from mcit.methods.lora import DropoutLinear, Lora, SwiftLoRAParams
from mcit.models.mllm import answer_token_ce


class LwFParams(SwiftLoRAParams):
    temperature: float = Field(2.0, gt=0, description="the distillation temperature T")
    lwf_alpha: float = Field(0.001, ge=0, description="weight of the distillation term (the trainer's alpha)")
    kl_positions: Literal["all", "answer"] = Field("all", description="all: every non-padding position (official "
                                                                      "sum); answer: the answer tokens' positions")


def distillation(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-sample ``T^2 * sum_positions KL(softmax(teacher / T) || softmax(student / T))`` over the positions
    ``mask`` keeps (B,): the official ``kl_div(..., reduction="batchmean") * T^2`` is the mean of these over the
    batch."""
    log_q = F.log_softmax(student.float() / temperature, dim=-1)
    p = F.softmax(teacher.float() / temperature, dim=-1)
    kl = F.kl_div(log_q, p, reduction="none").sum(-1)  # (B, L)
    return (kl * mask.to(kl.dtype)).sum(1) * temperature**2


@METHODS.register("lwf")
class LwF(Lora):
    name = "lwf"
    Params = LwFParams

    def __init__(self, params: LwFParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        self.teacher = copy.deepcopy(self.adapters).requires_grad_(False)
        for m in self.teacher.modules():
            if isinstance(m, DropoutLinear):
                m.dropout = nn.Identity()  # the official teacher runs in eval mode
        self.teacher_projector = (copy.deepcopy(self.projector).requires_grad_(False)
                                  if self.projector is not None else None)
        self.register_buffer("teacher_task", torch.tensor(-1))  # the task whose end the teacher holds (-1: none)
        from peft.tuners.lora import LoraLayer

        slot = {id(pair["A"]): key for key, pair in self.adapters.items()}
        # peft's LoRA layer of each adapter, by adapter key (not a submodule: the backbone is held by reference)
        self._peft = {slot[id(m.lora_A["default"])]: m for m in backbone.language_model.modules()
                      if isinstance(m, LoraLayer) and "default" in m.lora_A and id(m.lora_A["default"]) in slot}

    def before_task(self, task: int) -> None:
        """From the second task on, the teacher becomes the model as it is now: the end of task ``task - 1``. Only
        once per task (a train stage resumed on a state that already holds this task's teacher keeps it)."""
        super().before_task(task)
        if task > 0 and int(self.teacher_task) != task - 1:
            with torch.no_grad():
                for key, pair in self.adapters.items():
                    for k in ("A", "B"):
                        self.teacher[key][k].weight.copy_(pair[k].weight)
                if self.projector is not None:
                    for t, s in zip(self.teacher_projector.parameters(), self.projector.parameters()):
                        t.copy_(s)
            self.teacher_task.fill_(task - 1)

    @contextmanager
    def as_teacher(self) -> Iterator[None]:
        """The backbone computes with the teacher's adapters (and projector) inside."""
        for key, layer in self._peft.items():
            layer.lora_A["default"], layer.lora_B["default"] = self.teacher[key]["A"], self.teacher[key]["B"]
        if self.teacher_projector is not None:
            self.backbone.set_projector(self.teacher_projector)
        try:
            yield
        finally:
            for key, layer in self._peft.items():
                layer.lora_A["default"], layer.lora_B["default"] = self.adapters[key]["A"], self.adapters[key]["B"]
            if self.projector is not None:
                self.backbone.set_projector(self.projector)

    def teacher_logits(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The teacher's logits, attention mask and labels on ``batch`` (no gradients)."""
        with torch.no_grad(), self.as_teacher():
            e, m, lab, pos, _ = self._inputs(batch)
            return self.backbone.logits(e, m, pos), m, lab

    def train_outputs(self, batch: Batch) -> dict[str, Any]:
        distil = torch.is_grad_enabled() and int(self.teacher_task) >= 0  # not for the training-interference loss
        teacher = self.teacher_logits(batch) if distil else None
        e, m, lab, pos, extra = self._inputs(batch)
        logits = self.backbone.logits(e, m, pos)
        out = {**lm_outputs(answer_token_ce(logits, lab)), **extra}
        if teacher is not None:
            t_logits, t_mask, t_lab = teacher
            mask = t_mask if self.params.kl_positions == "all" else (t_lab != -100)
            out["distillation"] = distillation(logits, t_logits, mask, self.params.temperature)
        return out

    def loss(self, batch: Batch, outputs: dict[str, Any]) -> LossTerms:
        logs = {"lm_loss": float(outputs["lm_loss"].detach().mean())}
        if "distillation" not in outputs:
            return LossTerms(tokens=outputs["lm_tokens"], logs=logs)
        kd = outputs["distillation"]
        logs["lwf_loss"] = float(kd.detach().mean())
        return LossTerms(per_sample=self.params.lwf_alpha * kd, tokens=outputs["lm_tokens"], logs=logs)
