"""LLaVA / LLaVA-1.5 in transformers' layout (llava-hf, ``LlavaForConditionalGeneration``): the base's defaults.

What is its own: the checkpoints it refuses by name. A directory in the original LLaVA layout (haotian-liu/LLaVA's
``LlavaLlamaForCausalLM``: Llama keys at the top level, ``model.mm_projector``, the vision tower named by
``mm_vision_tower``) is read by transformers' ``LlavaConfig`` as LLaVA's defaults, so it would build a model of
another size with random weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from mcit.core.registry import BACKBONES
from mcit.models.base import BackboneError
from mcit.models.mllm import MLLMBackbone


@BACKBONES.register("llava")
class LlavaBackbone(MLLMBackbone):
    """LLaVA / LLaVA-1.5 (LlavaForConditionalGeneration)."""

    kind = "llava"
    model_class = "LlavaForConditionalGeneration"
    model_types = ("llava",)
    unquantized = ("lm_head", ".*vision_tower", ".*multi_modal_projector")
    images_alone = True

    @classmethod
    def check_files(cls, path: str) -> None:
        """The base's file check, after naming an original-layout LLaVA checkpoint as such."""
        cfg_file = Path(path) / "config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            if ("mm_vision_tower" in cfg or "mm_projector_type" in cfg
                    or "LlavaLlamaForCausalLM" in (cfg.get("architectures") or [])):
                raise BackboneError(f"backbone path {path} is an original LLaVA checkpoint (haotian-liu/LLaVA's "
                                    f"LlavaLlamaForCausalLM: mm_projector, vision tower from mm_vision_tower "
                                    f"{cfg.get('mm_vision_tower')!r}), which transformers' "
                                    f"LlavaForConditionalGeneration cannot load: convert it once with `python -m "
                                    f"data_prep.convert_llava --llava {path} --clip <CLIP directory> --out <new "
                                    f"directory>`")
        super().check_files(path)

    @classmethod
    def tiny(cls, texts: list[str], seed: int = 0) -> tuple[nn.Module, Any]:
        from mcit.models.tiny_llava import build_model, build_processor, train_tokenizer

        tok = train_tokenizer(texts)
        return build_model(tok, seed=seed), build_processor(tok, image_size=32, patch_size=8)
