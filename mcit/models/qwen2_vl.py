"""Qwen2-VL (``Qwen2VLForConditionalGeneration``).

Its own: pixel values are each image's flattened patches (a batch pads them to the longest image and
``image_grid_thw`` says how many are real; a text-only row has none and a 0 x 0 x 0 grid); the vision tower has
no [CLS], so the pooled image query is the mean merged image token (LLM width); 3-D M-RoPE position ids; and an
offline processor (``ImageTokenProcessor``) where transformers' cannot be built here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mcit.core.registry import BACKBONES
from mcit.data.types import Batch
from mcit.models.mllm import MLLMBackbone


class ImageTokenProcessor:
    """The part of a VLM processor the wrapper uses, assembled from a checkpoint's tokenizer (with its
    chat template) and image processor: image-token expansion by ``image_grid_thw``, as
    Qwen2VLProcessor does it. Used only where the full processor cannot be built: transformers 5.23's
    Qwen2VLProcessor requires a video processor, which requires torchvision (absent on CPU machines)."""

    def __init__(self, tokenizer: Any, image_processor: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.chat_template = chat_template or tokenizer.chat_template
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"

    @classmethod
    def from_pretrained(cls, path: str) -> "ImageTokenProcessor":
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

        template = Path(path) / "chat_template.jinja"
        return cls(AutoTokenizer.from_pretrained(path), Qwen2VLImageProcessorPil.from_pretrained(path),
                   template.read_text() if template.is_file() else None)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def __call__(self, text: list[str], images: list[Any], return_tensors: str = "pt",
                 padding: bool | str = True) -> dict[str, torch.Tensor]:
        img = self.image_processor(images=images, return_tensors=return_tensors)
        merge = self.image_processor.merge_size ** 2
        counts = iter((img["image_grid_thw"].prod(-1) // merge).tolist())
        expanded = []
        for t in text:
            parts = t.split(self.image_token)
            out = parts[0]
            for rest in parts[1:]:
                out += self.image_token * next(counts) + rest
            expanded.append(out)
        enc = self.tokenizer(expanded, return_tensors=return_tensors, padding=padding)
        return {**enc, "pixel_values": img["pixel_values"], "image_grid_thw": img["image_grid_thw"]}

    def save_pretrained(self, path: str | Path) -> None:
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)
        if self.chat_template:
            (Path(path) / "chat_template.jinja").write_text(self.chat_template)


@BACKBONES.register("qwen2_vl")
class Qwen2VLBackbone(MLLMBackbone):
    """Qwen2-VL (Qwen2VLForConditionalGeneration)."""

    kind = "qwen2_vl"
    model_class = "Qwen2VLForConditionalGeneration"
    model_types = ("qwen2_vl",)
    unquantized = ("lm_head", ".*visual")
    projector_path = "model.visual.merger"  # Qwen's patch merger: the MLP from the ViT into the LLM

    @classmethod
    def tiny(cls, texts: list[str], seed: int = 0) -> tuple[Any, Any]:
        from mcit.models.tiny_llava import build_qwen2_vl, train_tokenizer

        return build_qwen2_vl(train_tokenizer(texts), seed=seed)

    @classmethod
    def offline_processor(cls, path: str) -> Any:
        return ImageTokenProcessor.from_pretrained(path)  # no torchvision: no video processor

    def pooled_image_dim(self) -> int:
        """No [CLS] in the tower: the query is the mean merged image token, of the LLM's width."""
        return self.hidden_size

    def image_outputs(self, enc: dict) -> list[dict[str, Any]]:
        """pixel_values are every image's patches, one after another: split by each image's grid."""
        patches = torch.split(enc["pixel_values"], enc["image_grid_thw"].prod(-1).tolist())
        return [{"pixel_values": p, "image_grid_thw": enc["image_grid_thw"][row:row + 1]}
                for row, p in enumerate(patches)]

    def row_pixels(self, enc: dict, has_image: bool) -> Any:
        """(this image's patches, its grid); a text-only row has no patches and a 0 x 0 x 0 grid."""
        if not has_image:
            return None, torch.zeros(3, dtype=torch.long)
        return enc["pixel_values"], enc["image_grid_thw"][0]

    def batch_pixels(self, rows: list[Any], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Patches padded to the longest image; ``image_grid_thw`` says how many are real."""
        pix = [p for p, _ in rows]
        width = next((p.shape[1] for p in pix if p is not None), 1)
        n = max((p.shape[0] for p in pix if p is not None), default=1)
        inputs["image_grid_thw"] = torch.stack([g for _, g in rows])
        return torch.stack([torch.zeros(n, width) if p is None else torch.cat([p, p.new_zeros(n - p.shape[0], width)])
                            for p in pix])

    def real_pixels(self, batch: Batch, row: int) -> torch.Tensor:
        return batch.pixel_values[row, : int(batch.inputs["image_grid_thw"][row].prod())]

    def vision(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The merged image tokens of the rows with an image, and each row's mean merged token (zero for a
        text-only row, which has no patches)."""
        pixel_values = batch.pixel_values
        has = self.image_rows(batch)
        rows = has.nonzero().flatten().tolist()
        grid = batch.inputs["image_grid_thw"][has]
        pooled = pixel_values.new_zeros(pixel_values.shape[0], self.image_query_dim, dtype=self.dtype)
        if not rows:
            return pooled.new_zeros(0, 1, self.hidden_size), pooled
        counts = grid.prod(-1).tolist()
        flat = torch.cat([pixel_values[i, :c] for i, c in zip(rows, counts)]).to(self.dtype)
        parts = self.model.model.get_image_features(flat, grid, return_dict=True).pooler_output
        pooled[rows] = torch.stack([p.mean(0) for p in parts]).to(pooled.dtype)
        return torch.cat(list(parts)), pooled

    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        """transformers' own inputs: every image's patches one after another, the grids of the rows with an image,
        and the token types (1: image token) its M-RoPE index reads."""
        has = self.image_rows(batch)
        ids = batch.inputs["input_ids"]
        out = {"input_ids": ids, "attention_mask": batch.inputs["attention_mask"],
               "mm_token_type_ids": (ids == self.image_token_id).int()}
        if bool(has.any()):
            grid = batch.inputs["image_grid_thw"][has]
            rows = has.nonzero().flatten().tolist()
            out["pixel_values"] = torch.cat([batch.pixel_values[i, :c] for i, c in zip(rows, grid.prod(-1).tolist())]
                                            ).to(self.dtype)
            out["image_grid_thw"] = grid
        return out

    @torch.no_grad()
    def positions(self, batch: Batch) -> torch.Tensor | None:
        """The 3-D M-RoPE positions (3, B, L) of the batch's tokens."""
        ids = batch.inputs["input_ids"]
        grid = batch.inputs["image_grid_thw"]
        has = batch.inputs.get("has_image")
        grid = grid if has is None else grid[has]
        pos, _ = self.model.model.get_rope_index(ids, (ids == self.image_token_id).int(),
                                                 image_grid_thw=grid if len(grid) else None,
                                                 attention_mask=batch.inputs["attention_mask"])
        return pos
