"""``modal_prompt``: ModalPrompt (Zeng et al., arXiv 2410.05849, EMNLP 2025), dual-modality guided prompts for
MCIT, as in its official code (AuroraZengfh/ModalPrompt c7bee7c: ``llava/model/language_model/ModalPrompt.py``,
``llava/model/llava_arch.py: prepare_inputs_labels_for_multimodal``, ``llava/train/llava_trainer.py``,
``llava/train/train.py``; MCITlib's copy in Ghy0501/MCITlib 2956dfd ``ModalPrompt/`` differs where said below).

* **Prompts and prototypes.** Every task t has ``prefix_len`` prompt vectors in the LLM's input-embedding space
  (the official code adds them as new tokens ``[PRE{t}_{i}]`` to the vocabulary, each row a copy of a random row of
  the original vocabulary) and a prototype head: ``Linear(d, d) - SiLU - Linear(d, e)`` (d the LLM's width, e the
  guide features' width; the official code hard-codes 768, CLIP ViT-L/14's). The task's prototype is the mean over
  its prompt vectors of the head's output.
* **Dual-modality guidance.** A sample's image feature and text feature are compared with every seen task's
  prototype: ``guide = lam * cos(image, proto) + (1 - lam) * cos(text, proto)``. With ``guide: clip`` (the
  official encoders, an auxiliary CLIP at ``clip_path``: openai/clip-vit-large-patch14-336 in the official
  scripts, whose vision tower is also LLaVA-1.5's) the image feature is CLIP's projected image embedding
  (``CLIPVisionModelWithProjection.image_embeds``) and the text feature CLIP's text encoder on the instruction:
  ``CLIPTextModel.pooler_output`` (not projected: ``clip_text_feature: pooled``) of the sample decoded by the
  LLM's tokenizer (special tokens and the image skipped), its first line dropped and cut at " ASSISTANT" (the
  official rule for LLaVA's conversation: the first question). With ``guide: backbone`` (no auxiliary model) the
  image feature is the backbone's pooled vision feature and the text feature the mean frozen token embedding of
  the instruction (``MLLMBackbone.text_query``). Where the two features have one width (CLIP ViT-L/14: 768 and
  768) one prototype is compared with both, as in the official code; where they differ (the backbone's features,
  or a CLIP whose text width is not its projection width) the head's last layer gives an image part and a text
  part of their own widths.
* **Fusion.** ``transfer_num`` = K prompts go into the LLM's input right after BOS (``prompt_position``). Training
  task t: K = 1 takes task t's prompt alone; while t < K every seen task's prompt in task order; from then on the
  K - 1 earlier tasks of highest guide score, least similar first, then task t's own prompt, nearest the text.
  Inference after task t: the min(t, K) tasks of highest guide score over all seen tasks, least similar first.
  The official code fixes K = 3 (``transfer_num`` in ``prepare_inputs_labels_for_multimodal``; MCITlib's copy: 1).
  Selection is per sample.
* **Loss.** The answer-token loss plus ``(1 - cos(image, proto_t)) + (1 - cos(text, proto_t))`` with task t's
  prototype (weights 1, ``LLaVATrainer.compute_loss``): the alignment terms train task t's head and prompt.
* **Task boundary.** Only task t's prompt and head train; earlier ones are frozen (the official trainer resets
  every embedding row but task t's to its value at the task's start before each step; earlier heads have
  ``requires_grad`` off). ``train_projector``: the official ``initialize_vision_modules`` turns the pre-trained
  projector's gradients back on ("for prompt learning in case it is frozen by LoRA"), so it trains and carries
  over from task to task, in the one AdamW group of the DeepSpeed config's optimizer (``--mm_projector_lr`` is not
  read when the DeepSpeed JSON has an ``optimizer`` block): ``projector_lr: null`` (train.lr). MCITlib's copy
  builds a fresh projector that stays frozen: ``train_projector: false``.

Faults of the official code done right here (the project's rule: docs/architecture.md, "Known faults of the
official code"):

* the last task's prompt does not train: ``reset_vocab_size``'s mask ``mask[-P * (T - t + 1):-P * (T - t)]`` is
  empty when t = T (``-0``), so every step starts from the prompt's initial vocabulary copies and only the last
  step's update is kept (its head still trains). Here every task's prompt trains.
* the reset comes before each step, so the last step's update of every frozen row (earlier prompts and the whole
  vocabulary, which get gradients) stays in the saved embeddings and reaches the next task and the evaluation.
  Here frozen rows never change.

Other departures: the answer-token loss is the mean per sample, averaged over samples (the pipeline's rule for
every method; the official LlamaForCausalLM loss is the mean over the batch's answer tokens); the heads and prompts
are in the method's precision (the official code casts the heads to fp16 and trains in DeepSpeed's bf16); at
inference a sample without an image gets prompts chosen from its zero image and its text (LLaVA's generate returns
before any prompt is chosen when a sample has no image); the CLIP's image pass is a second pass over the
backbone's pixels (re-normalised and resized for the CLIP where its preprocessing differs from the backbone's;
LLaVA-1.5 with CLIP ViT-L/14-336 feeds it the same pixels, as the official single pass does). CLIP's text rule is
the official one for LLaVA's conversation (vicuna_v1, llava-hf's template: a line break after "USER: <image>"); a
chat template with no line break after the image gives CLIP an empty text (then use ``guide: backbone``).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import AuxiliaryBackbone, LossTerms, MethodParams, auxiliary_of
from mcit.methods.instruction import InstructionMethod
from mcit.methods.lora import install_projector


class ModalPromptParams(MethodParams):
    prefix_len: int = Field(10, ge=1, description="prompt vectors per task (official scripts: 10; MLLM-DCL: 20)")
    transfer_num: int = Field(3, ge=1, description="prompts fused per sample (official code: 3, MCITlib's: 1)")
    lam: float = Field(0.5, ge=0, le=1, description="weight of the image similarity (the text's: 1 - lam)")
    guide: Literal["clip", "backbone"] = Field(
        "clip", description="the features that choose prompts: the auxiliary CLIP's (official) or the backbone's")
    clip_path: str | None = Field(None, description="guide clip: the CLIP (official: "
                                                    "openai/clip-vit-large-patch14-336, an HF directory with its "
                                                    "tokenizer)", json_schema_extra={"input_path": True})
    clip_tag: str = Field("local", description="backbone zoo tag of clip_path, recorded with its sha256")
    clip_tokenizer: str | None = Field(None, description="clip_path an OpenAI file: a directory with its tokenizer",
                                       json_schema_extra={"input_path": True})
    clip_text_feature: Literal["pooled", "projected"] = Field(
        "pooled", description="CLIP's text feature: pooler_output (official) or its text projection")
    prompt_position: Literal["after_bos", "first"] = Field(
        "after_bos", description="right after a leading BOS (official) or before the first token")
    train_projector: bool = Field(True, description="train the vision projector (official; MCITlib's copy: false)")
    projector_lr: float | None = Field(None, gt=0, description="the projector's learning rate (null: train.lr)")

    @model_validator(mode="after")
    def _clip_only_with_clip_guide(self) -> "ModalPromptParams":
        if self.guide == "clip" and self.clip_path is None:
            raise ValueError("method.clip_path: guide clip needs the CLIP checkpoint (official: "
                             "openai/clip-vit-large-patch14-336); or set method.guide: backbone")
        if self.guide == "backbone" and (self.clip_path is not None or self.clip_tokenizer is not None):
            raise ValueError("method.clip_path / clip_tokenizer are read only with method.guide: clip")
        return self


def fusion_order(guide: torch.Tensor, task: int, k: int, training: bool) -> torch.Tensor:
    """Which tasks' prompts each sample gets, in input order (B, n): ``guide`` (B, task + 1) scores every seen
    task; ``task`` is the current one (0-based), ``k`` the number fused (the official ``transfer_num``)."""
    B, n = guide.shape[0], task + 1
    if training:
        if k == 1:
            return torch.full((B, 1), task, dtype=torch.long, device=guide.device)
        if n <= k - 1:
            return torch.arange(n, device=guide.device).expand(B, n)
        earlier = guide[:, :task].topk(k - 1, dim=-1).indices.flip(1)  # least similar first
        return torch.cat([earlier, torch.full((B, 1), task, dtype=torch.long, device=guide.device)], 1)
    return guide.topk(min(n, k), dim=-1).indices.flip(1)


def first_question(text: str) -> str:
    """The official rule that turns a decoded LLaVA conversation into CLIP's text: drop the first line (system
    prompt and "USER: <image>") and cut at " ASSISTANT"."""
    return "\n".join(text.split("\n")[1:]).split(" ASSISTANT")[0]


@METHODS.register("modal_prompt")
class ModalPrompt(InstructionMethod):
    name = "modal_prompt"
    Params = ModalPromptParams

    def __init__(self, params: ModalPromptParams, backbone: nn.Module, sequence: TaskSequence, *,
                 auxiliary: Mapping[str, nn.Module] | None = None) -> None:
        super().__init__(params, backbone, sequence)
        self._check_backbone()
        clip = auxiliary_of(auxiliary, "clip", self.name) if params.guide == "clip" else None
        object.__setattr__(self, "clip", clip)  # frozen, by reference: not in the state dict
        if clip is not None:
            self.image_dim = clip.projection_dim
            self.text_dim = clip.projection_dim if params.clip_text_feature == "projected" else clip.text_hidden_size
        else:
            self.image_dim, self.text_dim = backbone.image_query_dim, backbone.text_query_dim
        d, T = backbone.hidden_size, len(sequence)
        out = self.image_dim if self.shared_prototype else self.image_dim + self.text_dim
        # Every task's prompt a direct parameter of the method (under ZeRO-3 the method's own forward gathers them).
        for t, rows in enumerate(self._vocabulary_rows(T * params.prefix_len).view(T, params.prefix_len, d)):
            self.register_parameter(f"prompt{t}", nn.Parameter(rows.clone()))
        self.transforms = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, out)) for _ in range(T))
        self.projector = install_projector(backbone, params.train_projector, self.name)
        self.set_task(0)

    @classmethod
    def auxiliary_backbones(cls, params: ModalPromptParams) -> dict[str, AuxiliaryBackbone]:
        if params.guide != "clip":
            return {}
        return {"clip": AuxiliaryBackbone("clip", params.clip_path, params.clip_tag, params.clip_tokenizer,
                                          key="method.clip_path")}

    @property
    def shared_prototype(self) -> bool:
        """One prototype compared with both features (the official code) where they have one width."""
        return self.image_dim == self.text_dim

    def _vocabulary_rows(self, n: int) -> torch.Tensor:
        """``n`` copies of uniformly drawn rows of the original vocabulary (the tokenizer's own, without the
        tokens added later such as ``<image>``): the official ``add_prompt_tokens`` initialisation."""
        table = self.backbone.token_embeddings().detach()
        if table.is_meta:  # an architecture built without weights (mcit.models.inspect): shapes only
            return torch.empty(n, table.shape[1], device="meta")
        tok = getattr(self.backbone, "tokenizer", None)
        base = min(int(getattr(tok, "vocab_size", None) or table.shape[0]), table.shape[0])
        return table.float().cpu()[torch.randint(0, base, (n,))]

    # -- the task boundary ------------------------------------------------------------------------
    def prompt(self, task: int) -> nn.Parameter:
        return getattr(self, f"prompt{task}")

    def set_task(self, task: int) -> None:
        """Only task ``task``'s prompt and prototype head train; the others are frozen."""
        super().set_task(task)
        for t in range(len(self.transforms)):
            self.prompt(t).requires_grad_(t == task)
            self.transforms[t].requires_grad_(t == task)

    def trainable_parameters(self) -> list[nn.Parameter]:
        t = self.current_task
        return [self.prompt(t), *self.transforms[t].parameters(), *self.projector_parameters()]

    def projector_parameters(self) -> list[nn.Parameter]:
        return list(self.projector.parameters()) if self.projector is not None else []

    def param_groups(self) -> list[dict]:
        """Prompt and head at ``train.lr``; the projector (where trained) at ``projector_lr`` where one is set."""
        proj = self.projector_parameters()
        if not proj or self.params.projector_lr is None:
            return [{"params": self.trainable_parameters()}]
        ids = set(map(id, proj))
        return [{"params": [p for p in self.trainable_parameters() if id(p) not in ids]},
                {"params": proj, "lr": self.params.projector_lr}]

    # -- guidance -----------------------------------------------------------------------------------
    def prototypes(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(image part, text part) of the first ``n`` tasks' prototypes, (n, e) each (the same tensor where shared)."""
        protos = torch.stack([self.transforms[t](self.prompt(t).to(self.transforms[t][0].weight.dtype)).float().mean(0)
                              for t in range(n)])  # the heads' dtype: DeepSpeed's bf16 casts the method's weights
        if self.shared_prototype:
            return protos, protos
        return protos[:, : self.image_dim], protos[:, self.image_dim:]

    def instruction_texts(self, batch: Batch) -> list[str]:
        """CLIP's text of every sample: the official rule (``first_question``) on the sample decoded by the LLM's
        tokenizer without special tokens, image tokens and padding."""
        ids, mask = batch.inputs["input_ids"], batch.inputs["attention_mask"].bool()
        keep = mask & (ids != self.backbone.image_token_id)
        return [first_question(self.backbone.tokenizer.decode(row[k].tolist(), skip_special_tokens=True))
                for row, k in zip(ids, keep)]

    def clip_pixels(self, batch: Batch) -> torch.Tensor:
        """The batch's images as the CLIP takes them: the backbone's pixels as they are where the preprocessing
        agrees (LLaVA-1.5 and CLIP ViT-L/14-336), else re-normalised and resized for the CLIP."""
        px = batch.pixel_values
        if px.dim() != 4:
            raise ValueError(f"method.guide clip needs (B, 3, H, W) images; backbone {type(self.backbone).__name__} "
                             f"gives pixel values of shape {tuple(px.shape)}: set method.guide: backbone")
        ip = getattr(getattr(self.backbone, "processor", None), "image_processor", None)
        mean = torch.tensor(getattr(ip, "image_mean", [0.0] * 3), dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(getattr(ip, "image_std", [1.0] * 3), dtype=torch.float32).view(1, -1, 1, 1)
        clip = self.clip
        same = (px.shape[-1] == px.shape[-2] == clip.image_size and torch.allclose(mean, clip.mean.cpu().float())
                and torch.allclose(std, clip.std.cpu().float()))
        return px if same else clip.from_pixels_of(px, mean, std)

    @torch.no_grad()
    def guide_features(self, batch: Batch, embeds: torch.Tensor, image_query: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(image feature (B, e_image), text feature (B, e_text)), float32, frozen."""
        if self.clip is None:
            return image_query.float(), self.backbone.text_query(batch, embeds).float()
        model = self.clip.model
        px = self.clip_pixels(batch).to(device=self.clip.mean.device, dtype=self.clip.dtype)
        image = model.visual_projection(model.vision_model(pixel_values=px).pooler_output)
        text = model.text_model(**self.clip.tokenize(self.instruction_texts(batch))).pooler_output
        if self.params.clip_text_feature == "projected":
            text = model.text_projection(text)
        device = embeds.device
        return image.float().to(device), text.float().to(device)

    def select_prompts(self, batch: Batch, embeds: torch.Tensor, image_query: torch.Tensor
                       ) -> tuple[torch.Tensor, dict[str, Any]]:
        image, text = self.guide_features(batch, embeds, image_query)
        t, p = self.current_task, self.params
        proto_image, proto_text = self.prototypes(t + 1)
        cos_image = F.cosine_similarity(image[:, None], proto_image[None], dim=-1)  # (B, t + 1)
        cos_text = F.cosine_similarity(text[:, None], proto_text[None], dim=-1)
        guide = p.lam * cos_image + (1 - p.lam) * cos_text
        order = fusion_order(guide.detach(), t, p.transfer_num, self.training)
        table = torch.stack([self.prompt(i) for i in range(t + 1)])  # (t + 1, P, d)
        prompts = table[order].flatten(1, 2)  # (B, k * P, d)
        align_image = 1 - F.cosine_similarity(image, proto_image[t].expand_as(image), dim=-1)
        align_text = 1 - F.cosine_similarity(text, proto_text[t].expand_as(text), dim=-1)
        return prompts, {"align_image": align_image, "align_text": align_text, "selected": order, "guide": guide,
                         "cos_image": cos_image.detach(), "cos_text": cos_text.detach()}

    def _inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, dict[str, Any]]:
        return self.prompted_inputs(batch)

    def prompted_inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, dict[str, Any]]:
        """(embeddings, mask, labels, positions, selection outputs) the LLM runs on: the prompts right after a row's
        leading BOS (``prompt_position: after_bos``, the official ``cat(input_ids[:, :1], prompts,
        input_ids[:, 1:])``). The backbone inserts before the first token its mask shows, so the BOS is hidden from
        it for the insertion and shown again after."""
        embeds, image_query = self.backbone.input_embeddings(batch)
        prompts, extra = (None, {}) if self._bypass else self.select_prompts(batch, embeds, image_query)
        mask = batch.inputs["attention_mask"]
        bos = getattr(self.backbone.tokenizer, "bos_token_id", None)
        rows = torch.zeros(0, dtype=torch.long)
        first = (mask.cumsum(1) == 0).sum(1)  # leading pads per row
        if prompts is not None and self.params.prompt_position == "after_bos" and bos is not None:
            ids = batch.inputs["input_ids"]
            at = first.clamp_max(ids.shape[1] - 1)
            rows = torch.nonzero((ids.gather(1, at[:, None])[:, 0] == bos) & (first < ids.shape[1])).flatten()
            mask = mask.clone()
            mask[rows, first[rows]] = 0
        e, m, lab, pos = self.backbone.insert_prompts(embeds, mask, prompts, batch.labels,
                                                      self.backbone.positions(batch))
        if len(rows):
            m = m.clone()
            m[rows, first[rows]] = 1
        return e, m, lab, pos, extra

    def loss(self, batch: Batch, outputs: dict[str, Any]) -> LossTerms:
        lm = outputs["lm_loss"]
        if "align_image" not in outputs:  # the zero-shot model: no prompts
            return super().loss(batch, outputs)
        ai, at = outputs["align_image"], outputs["align_text"]
        return LossTerms(per_sample=ai + at, tokens=outputs["lm_tokens"],
                         logs={"lm_loss": float(lm.detach().mean()), "align_image": float(ai.detach().mean()),
                               "align_text": float(at.detach().mean())})
