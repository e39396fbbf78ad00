"""The project's own tiny LLaVA: tokenizer, processor and model built from config classes (no hub).

The tokenizer is trained here with the ``tokenizers`` library on the embedded benchmark's text and
wrapped as a ``PreTrainedTokenizerFast``; the processor is transformers' own ``LlavaProcessor``
assembled from that tokenizer, a CLIP image processor built from its config and a LLaVA-1.5 style
chat template. Saved with ``save_pretrained``, the directory loads with ``AutoProcessor`` and
``LlavaForConditionalGeneration.from_pretrained`` exactly like a real checkpoint.
"""

from __future__ import annotations

from typing import Any

SPECIAL = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>", "image": "<image>"}

# LLaVA-1.5's conversation format ("USER: <image>\n... ASSISTANT: ..."), as a chat template over
# transformers' message format (content = list of {"type": "image"} / {"type": "text", "text": ...}).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: "
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %} "
    "{% else %}ASSISTANT: {% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def train_tokenizer(texts: list[str], image_token_attribute: bool = True, extra_specials: tuple[str, ...] = (),
                    chat_template: str | None = CHAT_TEMPLATE) -> Any:
    """A word-level tokenizer over ``texts`` with LLaVA's special tokens, as PreTrainedTokenizerFast.

    ``image_token_attribute=False`` leaves out the ``image_token`` attribute: InstructBlipProcessor
    then registers ``<image>`` itself (transformers 5.23's processor expects that attribute to be an
    AddedToken, and a tokenizer that declares it as a string breaks it). ``extra_specials``: a family's own
    special tokens (Qwen's ``<|im_start|>``, InternVL's ``<img>``), after LLaVA's; ``chat_template``: the
    tokenizer's template (LLaVA-1.5's by default)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=SPECIAL["unk"]))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    specials = [SPECIAL[k] for k in ("pad", "bos", "eos", "unk", "image")] + list(extra_specials)
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials, min_frequency=1))
    bos = tok.token_to_id(SPECIAL["bos"])
    tok.post_processor = processors.TemplateProcessing(single=f"{SPECIAL['bos']} $A", pair=f"{SPECIAL['bos']} $A $B",
                                                       special_tokens=[(SPECIAL["bos"], bos)])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"], unk_token=SPECIAL["unk"],
        pad_token=SPECIAL["pad"], padding_side="right", chat_template=chat_template if image_token_attribute else None,
        **({"extra_special_tokens": {"image_token": SPECIAL["image"]}} if image_token_attribute else {}))


def build_processor(tokenizer: Any, image_size: int, patch_size: int) -> Any:
    """transformers' LlavaProcessor over the trained tokenizer and a CLIP image processor."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
        do_resize=True, do_center_crop=True, do_rescale=True, do_normalize=True,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_convert_rgb=True)
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                          vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
                          image_token=SPECIAL["image"], num_additional_image_tokens=1)


def build_model(tokenizer: Any, *, image_size: int = 32, patch_size: int = 8, vision_hidden: int = 64,
                vision_layers: int = 2, text_hidden: int = 128, text_layers: int = 3, heads: int = 4,
                seed: int = 0) -> Any:
    """A LlavaForConditionalGeneration (CLIP vision tower + Llama) from config classes."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vocab = len(tokenizer)
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                                       num_hidden_layers=vision_layers, num_attention_heads=heads,
                                       image_size=image_size, patch_size=patch_size),
        text_config=LlamaConfig(vocab_size=vocab, hidden_size=text_hidden, intermediate_size=3 * text_hidden,
                                num_hidden_layers=text_layers, num_attention_heads=heads, num_key_value_heads=heads,
                                max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                tie_word_embeddings=False),
        image_token_index=tokenizer.convert_tokens_to_ids(SPECIAL["image"]),
        image_seq_length=(image_size // patch_size) ** 2, vision_feature_layer=-1,
        vision_feature_select_strategy="default", projector_hidden_act="gelu",
    )
    cfg.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def build_instructblip(tokenizer: Any, *, image_size: int = 32, patch_size: int = 8, num_query_tokens: int = 8,
                       vision_hidden: int = 64, text_hidden: int = 64, seed: int = 0) -> tuple[Any, Any]:
    """A tiny InstructBLIP (BLIP-2 vision, Q-Former, Llama) and its InstructBlipProcessor, from config
    classes. The Q-Former reads the instruction with the same trained tokenizer."""
    import torch
    from transformers import (
        InstructBlipConfig,
        InstructBlipForConditionalGeneration,
        InstructBlipProcessor,
        InstructBlipQFormerConfig,
        InstructBlipVisionConfig,
        LlamaConfig,
    )
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

    image_token = tokenizer.convert_tokens_to_ids(SPECIAL["image"])
    cfg = InstructBlipConfig(
        vision_config=InstructBlipVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                                               num_hidden_layers=2, num_attention_heads=4, image_size=image_size,
                                               patch_size=patch_size).to_dict(),
        qformer_config=InstructBlipQFormerConfig(vocab_size=len(tokenizer), hidden_size=vision_hidden,
                                                 num_hidden_layers=2, num_attention_heads=4,
                                                 intermediate_size=2 * vision_hidden, encoder_hidden_size=vision_hidden,
                                                 pad_token_id=tokenizer.pad_token_id).to_dict(),
        text_config=LlamaConfig(vocab_size=len(tokenizer), hidden_size=text_hidden, intermediate_size=2 * text_hidden,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).to_dict(),
        num_query_tokens=num_query_tokens, image_token_index=image_token,
    )
    torch.manual_seed(seed)
    model = InstructBlipForConditionalGeneration(cfg)
    image_processor = BlipImageProcessorPil(size={"height": image_size, "width": image_size},
                                            image_mean=[0.5] * 3, image_std=[0.5] * 3, do_convert_rgb=True)
    processor = InstructBlipProcessor(image_processor=image_processor, tokenizer=tokenizer, qformer_tokenizer=tokenizer,
                                      num_query_tokens=num_query_tokens)
    return model, processor


def build_qwen2_vl(tokenizer: Any, *, image_size: int = 32, patch_size: int = 4, text_hidden: int = 64,
                   seed: int = 0, image_token: str = SPECIAL["image"], vision_start: str | None = None,
                   chat_template: str = CHAT_TEMPLATE) -> tuple[Any, Any]:
    """A tiny Qwen2-VL (its ViT with 2x2 patch merging and an M-RoPE LLM) from config classes, with the
    real Qwen2-VL image processor. Its processor is mcit's ImageTokenProcessor: transformers'
    Qwen2VLProcessor cannot be built without torchvision (its video processor needs it). ``image_token``,
    ``vision_start`` and ``chat_template``: Qwen's own (``<|image_pad|>``, ``<|vision_start|>``, its
    template) where the tokenizer has them; the demo's word-level tokenizer uses LLaVA's."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    from mcit.models.qwen2_vl import ImageTokenProcessor

    image_token_id = tokenizer.convert_tokens_to_ids(image_token)
    start = tokenizer.convert_tokens_to_ids(vision_start) if vision_start else tokenizer.bos_token_id
    cfg = Qwen2VLConfig(
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": text_hidden, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": patch_size, "spatial_merge_size": 2, "temporal_patch_size": 2},
        text_config={"vocab_size": len(tokenizer), "hidden_size": text_hidden, "intermediate_size": 2 * text_hidden,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                     "max_position_embeddings": 256, "pad_token_id": tokenizer.pad_token_id,
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}},
        image_token_id=image_token_id, video_token_id=tokenizer.unk_token_id, vision_start_token_id=start,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg)
    pixels = image_size * image_size
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=2, temporal_patch_size=2,
                                               min_pixels=pixels, max_pixels=pixels, image_mean=[0.5] * 3,
                                               image_std=[0.5] * 3)
    return model, ImageTokenProcessor(tokenizer, image_processor, chat_template)
