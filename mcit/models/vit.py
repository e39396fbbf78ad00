"""The frozen ViT backbone (transformers' own ViTModel) with the hooks prompt methods need.

We never copy the model: we call its own submodules (``embeddings``, ``layers``, ``layernorm``) in
order, which lets a method insert prompt tokens between the embedding and the first block, while the
weights stay the checkpoint's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

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


ATTENTION_NAME = "mcit_prompted"


@dataclass
class LayerPrompt:
    """What a method puts into one block's attention (any field may be None).

    ``key`` / ``value``: prefixes (B, H, P, head_dim) placed before the block's own keys and values
    (prefix tuning, as in DualPrompt's and CODA-Prompt's official code: the prefixes live in the
    per-head key/value space, after the projections). ``score_fn(scores, n_prefix)`` rewrites the
    pre-softmax scores (B, H, N, P + N) -- NoRGa's gate on the prefix columns. ``value_residual``
    (B, H, 1, head_dim) is added to every token's value (STAR-Prompt's residual prompt: since each
    attention row sums to 1, this adds W_o p to the block's attention output). ``capture(query,
    probs)`` sees the per-head queries (B, H, N, head_dim) and attention probabilities -- VPT-NSP²'s
    statistics.
    """

    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    value_residual: torch.Tensor | None = None
    score_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    capture: Callable[[torch.Tensor, torch.Tensor], None] | None = None


def prompted_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       mcit_prompt: LayerPrompt | None = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The attention function the frozen ViT runs with (registered in transformers' AttentionInterface).

    Without a LayerPrompt it is transformers' own SDPA path, so un-prompted blocks compute exactly
    what the checkpoint computes. With one it is eager attention with the prompt's prefixes, score
    rewrite and capture, which keeps the ViTLayer (norms, residuals, MLP) transformers' own.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if mcit_prompt is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                               dropout=dropout, **kwargs)
    n_prefix = 0
    if mcit_prompt.value_residual is not None:
        value = value + mcit_prompt.value_residual.to(value.dtype)
    if mcit_prompt.key is not None:
        n_prefix = mcit_prompt.key.shape[2]
        key = torch.cat([mcit_prompt.key.to(key.dtype), key], dim=2)
        value = torch.cat([mcit_prompt.value.to(value.dtype), value], dim=2)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if attention_mask is not None:
        scores = scores + attention_mask
    if mcit_prompt.score_fn is not None:
        scores = mcit_prompt.score_fn(scores, n_prefix)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if mcit_prompt.capture is not None:
        mcit_prompt.capture(query, probs)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return out, probs


class PromptableImageEncoder(nn.Module):
    """What the ViT and CLIP backbones share: preprocessing, the per-block encode loop with prompts,
    the frozen [CLS] query. A subclass provides ``layers``, ``final_norm``, ``embed``, ``image_size``,
    ``mean`` / ``std`` buffers and ``resample`` (PIL filter of the checkpoint's image processor)."""

    task_type = "classification"
    resample: int = 2  # PIL.Image.BILINEAR

    def preprocess(self, images: list) -> torch.Tensor:
        """PIL images -> normalised pixel values (RGB, resized to the model's size)."""
        import numpy as np

        arrs = []
        for im in images:
            im = im.convert("RGB")
            if im.size != (self.image_size, self.image_size):
                im = im.resize((self.image_size, self.image_size), self.resample)
            arrs.append(np.asarray(im, dtype=np.float32) / 255.0)
        x = torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2)
        return ((x - self.mean) / self.std).contiguous()

    def make_collate(self, split: Any, task: int, *, train: bool, label_index: dict[int, int]) -> Any:
        """How raw samples of ``split`` become a Batch (classification: images and class indices)."""
        from mcit.data.loader import classification_collate

        return classification_collate(self.preprocess, label_index, task, split)

    def encode(self, tokens: torch.Tensor, prompts: dict[int, LayerPrompt] | None = None,
               appended: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Run every block and the final LayerNorm (on every token) over a token sequence (B, T, D).

        ``prompts[i]``: block i's LayerPrompt (prefixes, value residual, score rewrite, capture).
        ``appended[i]`` (B, P, D): tokens appended to block i's input and dropped from its output
        (VPT-deep as in VPT-NSP²'s official code: each block gets fresh prompt tokens that only act
        through attention).
        """
        h = tokens
        for i, layer in enumerate(self.layers):
            lp = prompts.get(i) if prompts else None
            extra = appended.get(i) if appended else None
            if extra is not None:
                n = h.shape[1]
                h = layer(torch.cat([h, extra.to(h.dtype)], dim=1), None, mcit_prompt=lp)[:, :n]
            else:
                h = layer(h, None, mcit_prompt=lp)
        return self.final_norm(h)

    @torch.no_grad()
    def cls_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The frozen pre-trained [CLS] feature (final LayerNorm), the usual prompt-selection query."""
        return self.encode(self.embed(pixel_values))[:, 0]


@BACKBONES.register("vit")
class ViTBackbone(PromptableImageEncoder):
    """Frozen ViTModel plus its image processor settings."""

    def __init__(self, model: nn.Module, image_mean: list[float], image_std: list[float]) -> None:
        super().__init__()
        self.model = model
        self.model.requires_grad_(False)
        self.model.eval()
        self.image_size = int(model.config.image_size)
        self.hidden_size = int(model.config.hidden_size)
        self.num_layers = int(model.config.num_hidden_layers)
        self.num_heads = int(model.config.num_attention_heads)
        self.head_dim = self.hidden_size // self.num_heads
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, prompted_attention)
        self.model.set_attn_implementation(ATTENTION_NAME)
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
        bb = cls(model, proc.get("image_mean", [0.5] * 3), proc.get("image_std", [0.5] * 3))
        bb.resample = int(proc.get("resample", bb.resample))  # the checkpoint's resize filter (PIL code)
        return bb

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.layernorm(h)

    def key_proj(self, layer: int) -> nn.Linear:
        """Block ``layer``'s key projection (VPT-NSP² reads W_k from it)."""
        return self.model.layers[layer].attention.k_proj

    def linears(self, layer: int) -> dict[str, nn.Linear]:
        """Block ``layer``'s linear maps by role: q, k, v, o (attention output), fc1, fc2 (MLP)."""
        blk = self.model.layers[layer]
        a = blk.attention
        return {"q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj, "fc1": blk.mlp.fc1, "fc2": blk.mlp.fc2}

    def train(self, mode: bool = True) -> "ViTBackbone":  # frozen: always eval (no dropout drift)
        return super().train(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embeddings.patch_embeddings.projection.weight.dtype

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[CLS] + patch tokens with position embeddings: (B, 1 + N, D)."""
        return self.model.embeddings(pixel_values.to(self.dtype))

def load_backbone(kind: str, path: str, dtype: torch.dtype = torch.float32, **options: Any) -> nn.Module:
    """The registered backbone ``kind`` from ``path``; ``options`` are kind-specific (quantization, ...)."""
    return BACKBONES.get(kind).from_path(path, dtype=dtype, **options)
