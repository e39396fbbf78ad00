"""``hide_llava``: HiDe-LLaVA (Guo et al., ACL 2025, "HiDe-LLaVA: Hierarchical Decoupling for Continual Instruction
Tuning of Multimodal Large Language Model"), as its official code (Ghy0501/HiDe-LLaVA; MCITlib's copy ``HiDe/``).

Every target linear layer of the LLM (all of them: ``find_all_linear_names``) holds one LoRA pair per task, each of
rank ``r / T`` (the official ``lora_r`` split over ``expert_num`` = the number of tasks; A normal(0, 0.01), B zero),
all added with the scaling ``alpha / r``. ``HiDeMOELoraLinear.forward`` decides what they compute:

* training task t: task t's own pair alone, in every layer (the other tasks' pairs get no gradient);
* inference after task t, the layers below the top (task-general fusion): ``(sum_{i<=t} B_i) (sum_{i<=t} A_i) x``
  -- the seen tasks' A's and B's summed with weight 1 each, then multiplied (cross terms B_i A_j included);
* inference, the top layer (task-specific expansion): ``sum_i w_i B_i A_i x`` over every task's pair (those not
  trained yet too), ``w = softmax(sim / 0.1)`` with ``sim_i = (cos(image, image_anchor_i) + cos(text,
  text_anchor_i)) / 2`` (``llava_arch.prepare_inputs_labels_for_multimodal``). The image feature is CLIP's image
  embedding (``image_embeds``, projected, not normalised) of the sample's image, the text feature CLIP's text
  ``pooler_output`` (not projected) of its instruction; the anchors are their running means over each task's
  training samples, started from ``0.1 * randn`` counted as one sample (``LlavaLlamaForCausalLM.__init__``: anchors
  0.1 randn, boundaries 1). Routing covers every task (``set_eval(num_task)``, the total in the eval configs): a task
  not trained yet routes by its random anchors and adds its untrained pair.

The CLIP is an auxiliary backbone (``clip_path``; the official code reads both towers from LLaVA-1.5's own vision
tower checkpoint, openai/clip-vit-large-patch14-336), resolved and checked by pre-flight like the run's backbone.
The images reach it re-normalised from the backbone's pixels (``CLIPBackbone.from_pixels_of``); a text-only sample's
is the blank image LLaVA's training gives it. The projector trains along at ``projector_lr`` (the scripts'
``--mm_projector_lr 2e-5``). Defaults are MCITlib's UCIT scripts': r 96 (16 per task over 6 tasks), alpha 2 r,
dropout 0.05 (LLaVA's default), lr 2e-4.

Here every task's pair exists from the build (``_TaskA`` / ``_TaskB``: one block per task in peft's ``lora_A`` /
``lora_B`` slot; A's output is the concatenation over tasks, so B's concatenated blocks sum what A selects) and
only the current task's blocks train. The anchors are buffers, updated once per task by the subspace stage
(``statistics`` sums the features of the task's training split, ``finalize_statistics`` folds them into the
running mean): the official code updates them in every training forward, which gives the same mean. Departures,
each for a reason:

* the anchor counts are float32: the official ``image_boundary`` / ``text_boundary`` are bfloat16, whose count
  stops growing at 1024 when 4 samples are added per step (1024 + 4 rounds back to 1024), after which the "mean"
  becomes a growing sum (a bug; the direction, which routing reads, changes little);
* the anchors are means over every rank's samples, counted once: the official ones come from rank 0's share only
  (each rank updates its own copy, rank 0 saves), counted once per epoch (the same mean but for the prior's weight);
* routing is per sample: the official code takes the max similarity over the batch (``.max().item()``), which its
  evaluation runs one sample at a time;
* the instruction text is the sample's first question (``meta["first_question"]``) without its ``<image>``
  placeholder: what the official decoding (the decoded input without its first line, cut at the first
  `` ASSISTANT``) gives for LLaVA's ``<image>\\n``-first samples, single- or multi-turn.

Numbers against the official code: tests/reference/test_hide_llava_reference.py.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Mapping

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.task_lora import TaskBlocks, TaskLoRA, TaskLoRAParams

Mode = Literal["train", "infer", "off"]
_IMAGE_PLACEHOLDER = "<image>"


class HiDeLlavaParams(TaskLoRAParams):
    temperature: float = Field(0.1, gt=0, description="routing softmax temperature (official: sim / 0.1)")


class _TaskA(TaskBlocks):
    """peft's ``lora_A`` slot: every task's A block (``task{i}``: (r/T, in)), its output the concatenation over
    tasks of what each block contributes (``mode``, set before each forward by the method):

    ``train``: task ``task``'s block alone (zeros elsewhere); ``infer`` below the top: the fused ``sum_{i<=task} A_i``
    applied once and repeated in the blocks ``0..task`` (so that B's concatenation sums ``B_0..B_task``); ``infer``
    in the top layer: every block, each scaled by its routing weight (``gates``: (B, T), per sample); ``off``: zeros.
    ``dropout`` (the method's, so it follows its train / eval mode) acts on the input, as peft's slot would."""

    def __init__(self, blocks: list[torch.Tensor], dropout: float) -> None:
        super().__init__(blocks)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.top = False
        self.mode: Mode = "train"
        self.task = 0
        self.gates: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        """Task 0's block: peft reads only the dtype of ``lora_A.weight`` (a concatenation would be built in every
        forward of every layer for nothing)."""
        return self.task0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.blocks
        k = blocks[0].shape[0]
        if self.mode == "off":
            return x.new_zeros(*x.shape[:-1], k * len(blocks))
        x = self.dropout(x)
        if self.mode == "train":
            h = F.linear(x, blocks[self.task])
            return torch.cat([h if i == self.task else torch.zeros_like(h) for i in range(len(blocks))], dim=-1)
        if not self.top:
            fused = blocks[0]
            for b in blocks[1: self.task + 1]:  # the official order: 1.0 * A_0 + 1.0 * A_1 + ...
                fused = fused + b
            h = F.linear(x, fused)
            return torch.cat([h] * (self.task + 1) + [torch.zeros_like(h)] * (len(blocks) - self.task - 1), dim=-1)
        if self.gates is None:
            raise RuntimeError("hide_llava: the top layer was called for inference without routing weights")
        h = F.linear(x, torch.cat(blocks, dim=0))
        g = self.gates.to(h.dtype).repeat_interleave(k, dim=-1)
        return h * g.view(g.shape[0], *([1] * (h.dim() - 2)), g.shape[-1])


class _TaskB(TaskBlocks):
    """peft's ``lora_B`` slot: every task's B block (``task{i}``: (out, r/T)) concatenated along the rank, so that
    it sums ``B_i h_i`` over the blocks ``_TaskA`` filled."""

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat(self.blocks, dim=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)


def block_index(name: str) -> int:
    """The decoder block of an LLM module name (its first numeric component: ``layers.31.mlp.up_proj`` -> 31), as
    the official ``_get_submodules`` reads it from ``model.layers.31...``."""
    m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    if m is None:
        raise ValueError(f"method hide_llava: cannot tell the decoder block of module {name!r}")
    return int(m.group(1))


def instruction_text(question: str) -> str:
    """What the official code hands CLIP's text tower for a question: without the image placeholder."""
    return question.replace(_IMAGE_PLACEHOLDER, "").strip()


@METHODS.register("hide_llava")
class HiDeLlava(TaskLoRA):
    name = "hide_llava"
    Params = HiDeLlavaParams

    def __init__(self, params: HiDeLlavaParams, backbone: nn.Module, sequence: TaskSequence, *,
                 auxiliary: Mapping[str, nn.Module] | None = None) -> None:
        super().__init__(params, backbone, sequence, auxiliary=auxiliary)
        T = len(sequence)
        # the official anchors: 0.1 randn, their count (boundary) 1
        self.register_buffer("image_anchors", 0.1 * torch.randn(T, int(self.clip.projection_dim)))
        self.register_buffer("text_anchors", 0.1 * torch.randn(T, int(self.clip.text_hidden_size)))
        self.register_buffer("anchor_count", torch.ones(T))
        blocks = {name: block_index(name.replace("__", ".")) for name in self.adapters}
        self.top_layer = max(blocks.values())
        for name, m in self.adapters.items():
            m["A"].top = blocks[name] == self.top_layer
        self.set_task(0)

    def task_slots(self, a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[nn.Module, nn.Module]:
        return _TaskA(a, self.params.dropout), _TaskB(b)

    # -- the hierarchy --------------------------------------------------------------------------------
    def set_adapter_mode(self, mode: Mode, weights: torch.Tensor | None = None) -> None:
        """What the adapters compute in the next LLM forward: ``train`` (the current task's pair), ``infer`` (fused
        below the top layer, ``weights`` (B, T) mixing every task's pair in it) or ``off`` (nothing)."""
        if mode == "infer" and weights is None:
            raise ValueError("hide_llava: inference needs routing weights")
        for m in self.adapters.values():
            a = m["A"]
            a.mode, a.task = mode, self.current_task
            a.gates = weights if (mode == "infer" and a.top) else None

    def route(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Routing weights (B, T): softmax over tasks of the mean of the image and the text cosine similarity to
        each task's anchors, over the temperature. The mean is taken in float64 and rounded to float32, as the
        official code does (Python floats into numpy, then a float32 tensor)."""
        si = F.cosine_similarity(image.float().unsqueeze(1), self.image_anchors.unsqueeze(0), dim=-1)
        st = F.cosine_similarity(text.float().unsqueeze(1), self.text_anchors.unsqueeze(0), dim=-1)
        sim = ((si.double() + st.double()) / 2).float()
        return torch.softmax(sim / self.params.temperature, dim=-1)

    def _pixel_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        ip = getattr(getattr(self.backbone, "processor", None), "image_processor", None)
        mean, std = getattr(ip, "image_mean", None), getattr(ip, "image_std", None)
        if mean is None or std is None:
            raise ValueError(f"method hide_llava: backbone {type(self.backbone).__name__} has no image processor "
                             f"mean / std to re-normalise its pixels for CLIP")
        return (torch.tensor(mean, dtype=torch.float32).view(3, 1, 1),
                torch.tensor(std, dtype=torch.float32).view(3, 1, 1))

    @torch.no_grad()
    def guide_features(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample's CLIP image embedding (B, E) and its instruction's CLIP text pooler output (B, D_text):
        what the official code reads from its vision tower (``image_embeds``) and its text tower
        (``pooler_output``)."""
        px = batch.pixel_values
        if px.dim() != 4 or px.shape[1] != 3:
            raise ValueError(f"method hide_llava: backbone kind {getattr(self.backbone, 'kind', '?')} gives pixel rows "
                             f"of shape {tuple(px.shape[1:])}, not one image each; HiDe-LLaVA reads each sample's "
                             f"image with CLIP (LLaVA-1.5 in the official code)")
        if len(batch.meta) != px.shape[0] or any("question" not in m for m in batch.meta):
            raise ValueError("method hide_llava: the batch carries no question per sample (meta) for CLIP's text "
                             "tower")
        mean, std = self._pixel_stats()
        image = self.clip.image_features(self.clip.from_pixels_of(px, mean, std), normalize=False)
        enc = self.clip.tokenize([instruction_text(m.get("first_question") or m["question"]) for m in batch.meta])
        text = self.clip.model.text_model(**enc).pooler_output.float()
        return image, text

    def select_prompts(self, batch: Batch, embeds: torch.Tensor, image_query: torch.Tensor
                       ) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """No prompts; sets the adapters for this forward: the current task's pair while training (the method's
        train mode, as the official layers' ``self.training``), else fused and routed by this batch's samples."""
        if self.training:
            self.set_adapter_mode("train")
        else:
            self.set_adapter_mode("infer", self.route(*self.guide_features(batch)))
        return None, {}

    # -- anchors (subspace stage) --------------------------------------------------------------------
    def statistics(self, batch: Batch) -> dict[str, torch.Tensor]:
        image, text = self.guide_features(batch)
        v = batch.valid.to(image.device, torch.float32)
        return {"image": (image * v[:, None]).sum(0), "text": (text * v[:, None]).sum(0), "count": v.sum()}

    def finalize_statistics(self, reduced: dict[str, torch.Tensor], task: int) -> None:
        """Fold task ``task``'s feature sums into its anchors: (anchor * count + sum) / (count + n)."""
        if task < 0:
            return
        n = float(reduced["count"])
        c = float(self.anchor_count[task])
        with torch.no_grad():
            for key, anchors in (("image", self.image_anchors), ("text", self.text_anchors)):
                s = reduced[key].to(anchors.device, torch.float64)
                anchors[task] = ((anchors[task].double() * c + s) / (c + n)).to(anchors.dtype)
            self.anchor_count[task] = c + n

    def subspace_report(self) -> dict[str, Any]:
        return {"anchor_samples": [float(x) - 1.0 for x in self.anchor_count]}
