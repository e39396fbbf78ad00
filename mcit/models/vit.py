"""The frozen ViT backbone (transformers' own ViTModel) with the hooks prompt methods need.

We never copy the model: we call its own submodules (``embeddings``, ``layers``, ``layernorm``) in
order, which lets a method insert prompt tokens between the embedding and the first block, while the
weights stay the checkpoint's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mcit.registry import BACKBONES


class BackboneError(ValueError):
    """A backbone that cannot be loaded; one line naming the path."""


def check_checkpoint_dir(path: str | Path) -> dict:
    """Cheap pre-flight check (no weights loaded): the directory exists and holds an HF config."""
    p = Path(path)
    if not p.is_dir():
        raise BackboneError(f"backbone path not found: {p}")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise BackboneError(f"backbone path {p} has no config.json (not a transformers checkpoint directory)")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise BackboneError(f"backbone config {cfg} is not valid JSON: {e}") from None


@BACKBONES.register("vit")
class ViTBackbone(nn.Module):
    """Frozen ViTModel plus its image processor settings."""

    def __init__(self, model: nn.Module, image_mean: list[float], image_std: list[float]) -> None:
        super().__init__()
        self.model = model
        self.model.requires_grad_(False)
        self.model.eval()
        self.image_size = int(model.config.image_size)
        self.hidden_size = int(model.config.hidden_size)
        self.num_layers = int(model.config.num_hidden_layers)
        self.register_buffer("mean", torch.tensor(image_mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(image_std).view(1, -1, 1, 1), persistent=False)

    @classmethod
    def from_path(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "ViTBackbone":
        from transformers import ViTModel

        check_checkpoint_dir(path)
        try:
            model = ViTModel.from_pretrained(str(path), add_pooling_layer=False, dtype=dtype)
        except Exception as e:  # noqa: BLE001 - surface as one line naming the path
            raise BackboneError(f"cannot load ViT backbone from {path}: {str(e).splitlines()[0]}") from None
        proc: dict[str, Any] = {}
        pp = Path(path) / "preprocessor_config.json"
        if pp.is_file():
            proc = json.loads(pp.read_text())
        return cls(model, proc.get("image_mean", [0.5] * 3), proc.get("image_std", [0.5] * 3))

    def train(self, mode: bool = True) -> "ViTBackbone":  # frozen: always eval (no dropout drift)
        return super().train(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embeddings.patch_embeddings.projection.weight.dtype

    def preprocess(self, images: list) -> torch.Tensor:
        """PIL images -> normalised pixel values (RGB, resized to the model's size, bilinear)."""
        import numpy as np
        from PIL import Image

        arrs = []
        for im in images:
            im = im.convert("RGB")
            if im.size != (self.image_size, self.image_size):
                im = im.resize((self.image_size, self.image_size), Image.BILINEAR)
            arrs.append(np.asarray(im, dtype=np.float32) / 255.0)
        x = torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2)
        return ((x - self.mean) / self.std).contiguous()

    task_type = "classification"

    def make_collate(self, split: Any, task: int, *, train: bool, label_index: dict[int, int]) -> Any:
        """How raw samples of ``split`` become a Batch (classification: images and class indices)."""
        from mcit.data.loader import classification_collate

        return classification_collate(self.preprocess, label_index, task, split)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[CLS] + patch tokens with position embeddings: (B, 1 + N, D)."""
        return self.model.embeddings(pixel_values.to(self.dtype))

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run every block and the final LayerNorm over a token sequence (B, T, D)."""
        h = tokens
        for layer in self.model.layers:
            h = layer(h, None)
        return self.model.layernorm(h)

    @torch.no_grad()
    def cls_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The frozen pre-trained [CLS] feature (final LayerNorm), the usual prompt-selection query."""
        return self.encode(self.embed(pixel_values))[:, 0]


def load_backbone(kind: str, path: str, dtype: torch.dtype = torch.float32, **options: Any) -> nn.Module:
    """The registered backbone ``kind`` from ``path``; ``options`` are kind-specific (quantization, ...)."""
    return BACKBONES.get(kind).from_path(path, dtype=dtype, **options)
