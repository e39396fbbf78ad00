"""The frozen CLIP backbone (transformers' own CLIPModel) for the CLIP-based continual methods.

The image side has the same interface as :class:`mcit.models.vit.ViTBackbone` (``embed``, ``encode``
with per-block LayerPrompts and appended tokens, ``cls_features``, ``key_proj``), so a prompt method
written for the ViT runs on CLIP's image encoder unchanged. We call the model's own submodules in
order (embeddings, pre-LayerNorm, encoder layers, post-LayerNorm) and never copy the model.

The text side turns class names into classifier weights: every template filled with the class name,
encoded, L2-normalised, averaged over templates and normalised again (CLIP's prompt ensembling), and,
for methods that learn context tokens (STAR-Prompt), ``text_features_from_embeddings`` runs the
text transformer on given token embeddings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mcit.core.registry import BACKBONES
from mcit.models.base import (
    BackboneError,
    PromptableImageEncoder,
    check_hf_dir,
    check_model_type,
    check_weights,
    strict_from_pretrained,
)


@BACKBONES.register("clip")
class CLIPBackbone(PromptableImageEncoder):
    """Frozen CLIPModel, its tokenizer and its image normalisation (CLIP's own unless the checkpoint's
    preprocessor config says otherwise)."""

    resample = 3  # PIL.Image.BICUBIC, as CLIP's image processor
    model_types = ("clip",)
    default_mean = (0.48145466, 0.4578275, 0.40821073)
    default_std = (0.26862954, 0.26130258, 0.27577711)

    def __init__(self, model: nn.Module, image_mean: list[float], image_std: list[float],
                 tokenizer: Any = None) -> None:
        super().__init__(model, image_mean, image_std)
        self.tokenizer = tokenizer
        self.projection_dim = int(model.config.projection_dim)
        self.text_hidden_size = int(model.config.text_config.hidden_size)

    @classmethod
    def check(cls, path: str | Path) -> None:
        """An HF CLIP checkpoint directory with a tokenizer, whose weights fill ``CLIPModel`` exactly."""
        from transformers import CLIPModel

        cls.check_files(path)
        check_weights(CLIPModel, path)

    @classmethod
    def check_files(cls, path: str | Path) -> None:
        """An HF CLIP checkpoint directory with a tokenizer."""
        check_model_type(cls, path, check_hf_dir(path))
        p = Path(path)
        if not any((p / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json")):
            raise BackboneError(f"backbone path {path} has no tokenizer files (tokenizer.json or vocab.json)")

    @staticmethod
    def vision_config(model: nn.Module) -> Any:
        return model.config.vision_config

    @classmethod
    def load_model(cls, path: str | Path, dtype: torch.dtype) -> tuple[nn.Module, dict[str, Any]]:
        from transformers import AutoTokenizer, CLIPModel

        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return strict_from_pretrained(CLIPModel, path, dtype=dtype), {"tokenizer": tokenizer}

    @property
    def dtype(self) -> torch.dtype:
        return self.model.visual_projection.weight.dtype

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.vision_model.encoder.layers

    def key_proj(self, layer: int) -> nn.Linear:
        """Block ``layer``'s key projection (VPT-NSP² reads W_k from it)."""
        return self.layers[layer].self_attn.k_proj

    def linears(self, layer: int) -> dict[str, nn.Linear]:
        """Block ``layer``'s linear maps by role: q, k, v, o (attention output), fc1, fc2 (MLP)."""
        blk = self.layers[layer]
        a = blk.self_attn
        return {"q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.out_proj, "fc1": blk.mlp.fc1, "fc2": blk.mlp.fc2}

    # -- images ------------------------------------------------------------------------------------
    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[CLS] + patch tokens with position embeddings, after CLIP's pre-LayerNorm: (B, 1 + N, D)."""
        vm = self.model.vision_model
        return vm.pre_layrnorm(vm.embeddings(pixel_values.to(self.dtype)))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """CLIP's post-LayerNorm, on every token (the [CLS] row is CLIP's pooled output)."""
        return self.model.vision_model.post_layernorm(h)

    def project_image(self, pooled: torch.Tensor) -> torch.Tensor:
        """CLIP's visual projection of pooled features, L2-normalised."""
        return F.normalize(self.model.visual_projection(pooled.to(self.dtype)).float(), dim=-1)

    @torch.no_grad()
    def image_features(self, pixel_values: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """CLIP image embeddings of the frozen model (B, E), L2-normalised unless ``normalize=False``."""
        if normalize:
            return self.project_image(self.cls_features(pixel_values))
        return self.model.visual_projection(self.cls_features(pixel_values)).float()

    def from_pixels_of(self, pixel_values: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        """Re-normalise images prepared for another backbone (its ``mean`` / ``std``) for this CLIP,
        resized to CLIP's input size (bicubic) where the sizes differ."""
        import torch.nn.functional as F

        x = pixel_values.float() * std.to(pixel_values.device) + mean.to(pixel_values.device)
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bicubic", align_corners=False,
                              antialias=True)
        return (x - self.mean) / self.std

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.model.logit_scale

    # -- text --------------------------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        max_len = int(self.model.config.text_config.max_position_embeddings)
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        return {k: v.to(self.mean.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}

    @torch.no_grad()
    def text_features(self, texts: list[str]) -> torch.Tensor:
        """Normalised CLIP text embeddings (N, E)."""
        out = self.model.get_text_features(**self.tokenize(texts))
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        return F.normalize(feats.float(), dim=-1)

    @torch.no_grad()
    def class_text_features(self, class_names: list[str], templates: list[str]) -> torch.Tensor:
        """One normalised embedding per class: the mean over ``templates`` (each with one ``{}``)."""
        texts = [t.format(c) for c in class_names for t in templates]
        f = self.text_features(texts).view(len(class_names), len(templates), -1).mean(dim=1)
        return F.normalize(f, dim=-1)

    def text_features_from_embeddings(self, embeds: torch.Tensor, input_ids: torch.Tensor,
                                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Normalised text embeddings from token embeddings (N, L, D) in place of the token lookup
        (learned context tokens), pooled at each row's end-of-text token of ``input_ids``."""
        from transformers.masking_utils import create_causal_mask

        tm = self.model.text_model
        hidden = tm.embeddings(inputs_embeds=embeds.to(self.dtype))
        mask = create_causal_mask(config=tm.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  past_key_values=None)
        hidden = tm.encoder(inputs_embeds=hidden, attention_mask=mask, is_causal=True).last_hidden_state
        hidden = tm.final_layer_norm(hidden)
        if tm.eos_token_id == 2:
            pos = input_ids.to(torch.int).argmax(dim=-1)
        else:
            pos = (input_ids.to(torch.int) == tm.eos_token_id).int().argmax(dim=-1)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), pos]
        return F.normalize(self.model.text_projection(pooled).float(), dim=-1)
