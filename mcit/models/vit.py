"""The frozen ViT backbone: transformers' own ViTModel behind ``PromptableImageEncoder``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mcit.core.registry import BACKBONES
from mcit.models.base import PromptableImageEncoder, check_weights, strict_from_pretrained


@BACKBONES.register("vit")
class ViTBackbone(PromptableImageEncoder):
    """Frozen ViTModel (no pooler) plus its image-processor settings (mean / std 0.5 unless the
    checkpoint's preprocessor config says otherwise)."""

    # the pooler is not used (prompt methods read the [CLS] token after the final norm): a checkpoint's pooler
    # weights are dropped on purpose
    DROPPED = ("pooler.",)
    model_types = ("vit",)

    @classmethod
    def check(cls, path: str | Path) -> None:
        """An HF ViT directory whose weights fill ``ViTModel`` (no pooler) exactly."""
        from transformers import ViTModel

        cls.check_files(path)
        check_weights(ViTModel, path, ignore_unexpected=cls.DROPPED, add_pooling_layer=False)

    @classmethod
    def load_model(cls, path: str | Path, dtype: torch.dtype) -> tuple[nn.Module, dict[str, Any]]:
        from transformers import ViTModel

        return strict_from_pretrained(ViTModel, path, cls.DROPPED, add_pooling_layer=False, dtype=dtype), {}

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embeddings.patch_embeddings.projection.weight.dtype

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[CLS] + patch tokens with position embeddings: (B, 1 + N, D)."""
        return self.model.embeddings(pixel_values.to(self.dtype))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.layernorm(h)

    def cls_position_embedding(self) -> torch.Tensor:
        return self.model.embeddings.position_embeddings[0, 0]

    def key_proj(self, layer: int) -> nn.Linear:
        """Block ``layer``'s key projection (VPT-NSP² reads W_k from it)."""
        return self.model.layers[layer].attention.k_proj

    def linears(self, layer: int) -> dict[str, nn.Linear]:
        """Block ``layer``'s linear maps by role: q, k, v, o (attention output), fc1, fc2 (MLP)."""
        blk = self.model.layers[layer]
        a = blk.attention
        return {"q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj, "fc1": blk.mlp.fc1, "fc2": blk.mlp.fc2}
