"""``disco``: DISCO (Guo et al., ICCV 2025, "Federated Continual Instruction Tuning": Dynamic Knowledge Organization +
Subspace Selective Activation), centralised as MCITlib runs it (Ghy0501/MCITlib ``DISCO/``, its copy of the method of
Ghy0501/FCIT).

What the official code does (``CoIN/peft/tuners/clitmoelora.py``, ``llava/model/llava_arch.py``,
``llava/model/language_model/llava_llama.py``, ``llava/train/train_MOE.py``, ``scripts/CoIN/Train_UCIT``):

* every linear layer of the LLM (``find_all_linear_names``) holds one LoRA subspace per task: ``expert_num`` (= the
  number of tasks) pairs of rank ``r / T`` (A normal(0, 0.01), B zero), all added with the scaling ``alpha / r``;
* dynamic knowledge organization, centralised: task t trains its own subspace (``lora_id = cur_task``) in every
  layer, alone; the other subspaces get no gradient and keep their values;
* each task's key: the CLIP text feature (the text tower's ``pooler_output``, not projected) of its training
  instructions, accumulated by every training forward into ``global_text_feature[t]`` (zeros until the task
  trains);
* subspace selective activation, at inference: ``w = softmax(cos(text, key_i) / 0.05)`` over every task's key
  (``set_eval(num_task)``: the tasks not trained yet too, whose zero key gives cosine 0), and every layer computes
  ``W x + alpha / r * sum_i w_i B_i A_i x`` (concatenated A, ``lora_AB`` = block-diag(w_i I), concatenated B). The
  text is the sample's instruction: the decoded input without its first line, cut at `` ASSISTANT`` -- the first
  question without its ``<image>`` placeholder (``meta["first_question"]``, as ``hide_llava``). The official code
  also accumulates CLIP image-embedding keys, but its routing reads the text alone (``cos_sim =
  cos_sim_text[:expert_num]  # 0.5 * cos_sim_text + 0.5 * cos_sim_img``); they are not kept here.

The CLIP is an auxiliary backbone (``clip_path``; the official scripts read it from LLaVA-1.5's vision tower
checkpoint, openai/clip-vit-large-patch14-336, ``--text_tower $VISION_TOWER``). The projector trains along at
``projector_lr`` (``--mm_projector_lr 2e-5``). Defaults are MCITlib's UCIT scripts': r 96 over 6 tasks (16 each),
alpha 2 r, dropout 0.05 (LLaVA's default), lr 2e-4 (its MLLM-DCL scripts: r 160 over 5 tasks, lr 2e-5).

The federated method (Ghy0501/FCIT 9b10259, ``ETrain/Fed_utils/model_aggregation.py``, ``ETrain/Models/LLaVA/
llava_arch.py``) organizes clients instead of tasks: a client trains the subspace whose key has cosine > 0.9 with its
batch's mean instruction feature, else a fresh one; the server groups the round's clients whose mean features have
cosine >= 0.9, averages each group's subspace (FedAvg, weighted by sample counts) and keeps the group's mean feature
as the subspace's key (FCIT's copy also routes the MLP projections only; MCITlib's every projection). Centralised,
with one data stream per task, that is one subspace per task, which is all MCITlib runs and all that is built here.
The data-parallel ranks are one client: their statistics are summed. Federation would map a client to a group of
ranks with its own data, each group's feature sums reduced within the group and clustered in ``finalize_statistics``
(not built).

Here every task's pair exists from the build (``SubspaceA`` / ``SubspaceB`` in peft's ``lora_A`` / ``lora_B`` slot,
one block per task) and only the current task's blocks train. Departures, each for a reason:

* the keys are float32 means over the task's training split, all ranks, computed once by the subspace stage
  (``statistics`` sums the text features, ``finalize_statistics`` divides). The official key is meant as a running
  mean, but its count is never incremented (``global_text_feature[t].data += n`` adds the count to the feature,
  which the next line overwrites), so it is a bfloat16 running sum over every training forward of rank 0's share,
  every epoch. Routing reads only the key's direction (cosine), and the bfloat16 sum's direction drifts from the
  exact sum's: over 5,000 batch means of width 768 its cosine to the exact sum was 0.997 for zero-mean
  unit-variance features, 0.934 and 0.915 with a per-coordinate mean of scale 1 and 0.5 beside the unit noise
  (torch, seed 0), 0.967 in an independent measurement of the official accumulation. The sum is a bug (the count
  was meant to make it a mean) and its bfloat16 rounding an accident of the parameter's dtype: the key here is the
  exact float32 mean, with no option for the drift;
* routing is per sample: the official code routes a batch by its mean text feature (its evaluation runs one sample
  at a time, ``llava/eval/CoIN/model_others.py``);
* the official ``lora_AB`` (an r x r ``lora_`` parameter rewritten with block-diag(w_i I) by every evaluation
  forward) is not a parameter here: the routing weights scale A's output blocks, the same product.

Numbers against the official code: tests/reference/test_disco_reference.py.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.hide_llava import instruction_text
from mcit.methods.task_lora import TaskBlocks, TaskLoRA, TaskLoRAParams

Mode = Literal["train", "infer", "off"]


class DiscoParams(TaskLoRAParams):
    temperature: float = Field(0.05, gt=0, description="activation softmax temperature (official: cos / 0.05)")


class SubspaceRoute:
    """What every adapted layer computes in the next LLM forward, shared by all of them (set by the method):
    ``train`` (task ``task``'s subspace alone), ``infer`` (every subspace, weighted per sample by ``gates`` (B, T)),
    ``off`` (nothing)."""

    def __init__(self) -> None:
        self.mode: Mode = "train"
        self.task = 0
        self.gates: torch.Tensor | None = None


class SubspaceA(TaskBlocks):
    """peft's ``lora_A`` slot: every task's A block (``task{i}``: (r/T, in)). Training: task ``task``'s block alone
    ((..., r/T)); inference: every block, each scaled by its sample's routing weight ((..., r)); off: zeros. The
    method's dropout acts on the input, as peft's slot would."""

    def __init__(self, blocks: list[torch.Tensor], dropout: float, route: SubspaceRoute) -> None:
        super().__init__(blocks)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.route = route

    @property
    def weight(self) -> torch.Tensor:
        """Task 0's block: peft reads only the dtype of ``lora_A.weight``."""
        return self.task0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route, blocks = self.route, self.blocks
        k = blocks[0].shape[0]
        if route.mode == "off":
            return x.new_zeros(*x.shape[:-1], k * len(blocks))
        x = self.dropout(x)
        if route.mode == "train":
            return F.linear(x, blocks[route.task])
        if route.gates is None:
            raise RuntimeError("disco: an adapted layer was called for inference without routing weights")
        h = F.linear(x, torch.cat(blocks, dim=0))
        g = route.gates.to(h.dtype).repeat_interleave(k, dim=-1)
        return h * g.view(g.shape[0], *([1] * (h.dim() - 2)), g.shape[-1])


class SubspaceB(TaskBlocks):
    """peft's ``lora_B`` slot: every task's B block (``task{i}``: (out, r/T)); training applies task ``task``'s
    block, otherwise the blocks side by side sum what ``SubspaceA`` weighted."""

    def __init__(self, blocks: list[torch.Tensor], route: SubspaceRoute) -> None:
        super().__init__(blocks)
        self.route = route

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat(self.blocks, dim=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.route.mode == "train":
            return F.linear(h, self.blocks[self.route.task])
        return F.linear(h, self.weight)


@METHODS.register("disco")
class Disco(TaskLoRA):
    """``keys`` (T, D_text): each finished task's mean CLIP text feature (zeros before); ``key_count``: its samples."""

    name = "disco"
    Params = DiscoParams

    def __init__(self, params: DiscoParams, backbone: nn.Module, sequence: TaskSequence, *,
                 auxiliary: Mapping[str, nn.Module] | None = None) -> None:
        self.route = SubspaceRoute()  # before the layers are built: every A / B module reads it
        super().__init__(params, backbone, sequence, auxiliary=auxiliary)
        T = len(sequence)
        self.register_buffer("keys", torch.zeros(T, int(self.clip.text_hidden_size)))  # the official zeros
        self.register_buffer("key_count", torch.zeros(T))
        self.set_task(0)

    def task_slots(self, a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[nn.Module, nn.Module]:
        """One subspace per task of rank r / T."""
        return SubspaceA(a, self.params.dropout, self.route), SubspaceB(b, self.route)

    # -- subspace selective activation ----------------------------------------------------------------------
    def set_adapter_mode(self, mode: Mode, weights: torch.Tensor | None = None) -> None:
        """What the adapted layers compute in the next LLM forward: ``train`` (the current task's subspace), ``infer``
        (every subspace, ``weights`` (B, T) per sample) or ``off`` (nothing)."""
        if mode == "infer" and weights is None:
            raise ValueError("disco: inference needs routing weights")
        self.route.mode, self.route.task = mode, self.current_task
        self.route.gates = weights if mode == "infer" else None

    def route_weights(self, text: torch.Tensor) -> torch.Tensor:
        """(B, T): softmax over every task of the cosine of each sample's text feature with the task's key, over the
        temperature (a task not trained yet has a zero key: cosine 0)."""
        sim = F.cosine_similarity(text.float().unsqueeze(1), self.keys.unsqueeze(0), dim=-1)
        return torch.softmax(sim / self.params.temperature, dim=-1)

    @torch.no_grad()
    def text_features(self, batch: Batch) -> torch.Tensor:
        """Each sample's instruction's CLIP text ``pooler_output`` (B, D_text): what the official text tower gives."""
        if len(batch.meta) != len(batch) or any("question" not in m for m in batch.meta):
            raise ValueError("method disco: the batch carries no question per sample (meta) for CLIP's text tower")
        enc = self.clip.tokenize([instruction_text(m.get("first_question") or m["question"]) for m in batch.meta])
        return self.clip.model.text_model(**enc).pooler_output.float()

    def select_prompts(self, batch: Batch, embeds: torch.Tensor, image_query: torch.Tensor
                       ) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """No prompts; sets the adapters for this forward: the current task's subspace while training (the method's
        train mode, as the official layers' ``self.training``), else every subspace weighted by each sample."""
        if self.training:
            self.set_adapter_mode("train")
        else:
            self.set_adapter_mode("infer", self.route_weights(self.text_features(batch)))
        return None, {}

    # -- the keys (subspace stage) ----------------------------------------------------------------------------
    def statistics(self, batch: Batch) -> dict[str, torch.Tensor]:
        text = self.text_features(batch)
        v = batch.valid.to(text.device, torch.float32)
        return {"text": (text * v[:, None]).sum(0), "count": v.sum()}

    def finalize_statistics(self, reduced: dict[str, torch.Tensor], task: int) -> None:
        """Task ``task``'s key: the mean text feature of its training samples (summed over ranks)."""
        n = float(reduced["count"])
        if task < 0 or n <= 0:
            return
        with torch.no_grad():
            self.keys[task] = (reduced["text"].to(self.keys.device, torch.float64) / n).to(self.keys.dtype)
            self.key_count[task] = n

    def subspace_report(self) -> dict[str, Any]:
        return {"key_samples": [int(x) for x in self.key_count]}
