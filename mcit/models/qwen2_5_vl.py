"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``).

To the wrapper it is Qwen2-VL: each image's flattened patches with its ``image_grid_thw``, 3-D M-RoPE
positions from the model's own ``get_rope_index``, merged image tokens from ``get_image_features``. What
differs lives inside transformers' classes -- the ViT attends within windows of merged patches in most
blocks (full attention in ``fullatt_block_indexes`` only), RMSNorm + SwiGLU in the ViT, a projector to
the LLM's width (``out_hidden_size``), timestamps for videos -- so ``Qwen2_5_VLBackbone`` only names the
class, the published chat template and a tiny model that exercises the windows. Its processor needs a
video processor (torchvision) as Qwen2-VL's does: the same offline ``ImageTokenProcessor``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mcit.core.registry import BACKBONES
from mcit.models.qwen2_vl import ImageTokenProcessor, Qwen2VLBackbone

# Qwen/Qwen2.5-VL-7B-Instruct chat_template.json, as published (the default system prompt is written when the
# conversation has none).
QWEN2_5_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)

# Qwen's vision and chat special tokens (Qwen2-VL, Qwen2.5-VL and Qwen3-VL share them).
QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def qwen_tokenizer(texts: list[str], chat_template: str) -> Any:
    """The project's word-level tokenizer (``train_tokenizer``) with Qwen's special tokens and behaviour: no BOS
    in front of a text, ``<|im_end|>`` the end of an assistant turn and of generation, ``<|image_pad|>`` the
    image token (no ``image_token`` attribute: the processor then uses Qwen's), the template's words known."""
    from tokenizers import processors

    from mcit.models.tiny_llava import train_tokenizer

    words = ["system user assistant You are a helpful assistant."]
    tok = train_tokenizer(list(texts) + words, image_token_attribute=False, extra_specials=QWEN_SPECIALS)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    tok.eos_token = "<|im_end|>"
    tok.bos_token = None
    tok.chat_template = chat_template
    return tok


def qwen_image_processor(patch_size: int, mean: list[float], std: list[float], image_size: int = 32) -> Any:
    """Qwen's image processor (the PIL one: no torchvision) resizing every image to about ``image_size``^2
    pixels (the checkpoints' own budgets are far larger)."""
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    pixels = image_size * image_size
    return Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=2, temporal_patch_size=2, min_pixels=pixels,
                                    max_pixels=pixels, image_mean=mean, image_std=std)


@BACKBONES.register("qwen2_5_vl")
class Qwen2_5_VLBackbone(Qwen2VLBackbone):
    """Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): Qwen2-VL's inputs; window attention in its ViT."""

    kind = "qwen2_5_vl"
    model_class = "Qwen2_5_VLForConditionalGeneration"
    model_types = ("qwen2_5_vl",)
    unquantized = ("lm_head", ".*visual")

    @classmethod
    def tiny(cls, texts: list[str], seed: int = 0) -> tuple[nn.Module, Any]:
        """A 32 x 32 image is 8 x 8 patches of 4 pixels, 4 x 4 merged tokens; a 16-pixel window holds 2 x 2 merged
        tokens, so the image has 4 windows: block 0 attends within them, block 1 (``fullatt_block_indexes``) over
        the whole image, as the 7B's blocks do (windows of 112 pixels, full attention every 8th block)."""
        return cls.tiny_from_tokenizer(qwen_tokenizer(texts, QWEN2_5_VL_TEMPLATE), seed)

    @classmethod
    def tiny_from_tokenizer(cls, tok: Any, seed: int = 0) -> tuple[nn.Module, Any]:
        """``tiny`` over a given tokenizer (Qwen's special tokens, ``<|im_end|>`` its EOS, a chat template): the
        chat-format test's byte-level one."""
        import torch
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        ids = tok.convert_tokens_to_ids
        cfg = Qwen2_5_VLConfig(
            vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
                           "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64,
                           "window_size": 16, "fullatt_block_indexes": [1], "tokens_per_second": 2},
            text_config={"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                         "pad_token_id": tok.pad_token_id, "bos_token_id": None, "eos_token_id": tok.eos_token_id,
                         "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}},
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        )
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(cfg)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        processor = qwen_image_processor(4, mean=[0.48145466, 0.4578275, 0.40821073],  # the 7B's: CLIP's
                                         std=[0.26862954, 0.26130258, 0.27577711])
        return model, ImageTokenProcessor(tok, processor, tok.chat_template)
