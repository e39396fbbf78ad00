"""LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``: SigLIP + Qwen2, llava-hf layout).

Its own: *anyres* images. The image processor cuts each image into the crops of the best grid among
``image_grid_pinpoints`` plus a base crop (the whole image resized), so an image's pixel values are
(patches, 3, H, W) with a per-image number of patches; the model unpads the grid's features by the image's
original size (``image_sizes``), caps them at ``vision_aspect_ratio`` ("anyres_max_9": at most about 9 crops'
worth, bilinearly shrunk beyond), and ends each feature row with an ``image_newline``. The number of image
tokens therefore depends on each image's size: the processor computes it (``_get_number_of_features``) and the
model's feature count must equal it for every size.

A batch row carries its own patches, zero-padded to the most patches the pinpoints can give, so that a row is
the same whatever else is in its batch; ``image_patches`` (real count) and ``image_sizes`` (original H, W) in
``batch.inputs`` say what is real. The pooled image query is the vision tower's mean output token over the base
crop (SigLIP here has no pooling head: ``vision_use_head`` is off in OneVision's checkpoints; the base crop sees
the whole image whatever its grid). transformers 5.23's LlavaOnevisionProcessor needs a video processor,
hence torchvision; ``AnyresImageTokenProcessor`` is the offline part of it the wrapper uses, its image-token
count taken from LlavaOnevisionProcessor's own methods.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mcit.core.registry import BACKBONES
from mcit.data.types import Batch
from mcit.models.mllm import MLLMBackbone

# llava-hf/llava-onevision-qwen2-0.5b-ov-hf chat_template.json (also transformers' LlavaOnevisionProcessor
# tests): role + " ", the image placeholder(s), then "\n" + text, "<|im_end|>" with no newline after it; the
# generation prompt is "<|im_start|>assistant\n" (no space).
ONEVISION_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}"
    "{# Render all video then #}{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}"
    "{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\\n' + content['text'] }}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ '\\n' + content['text'] }}{% endgeneration %}{% endfor %}{% endif %}"
    "{{'<|im_end|>'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ("<|im_start|>", "<|im_end|>", "<video>")
# A tiny anyres grid: up to 2 x 2 crops of 32 px. "anyres_max_2" caps the features below the largest grid, as
# anyres_max_9 does for OneVision's 6 x 6 grid, so the tiny model also runs the bilinear shrink.
TINY_PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64]]


class AnyresImageTokenProcessor:
    """The part of LlavaOnevisionProcessor the wrapper uses, assembled from a checkpoint's tokenizer, its
    ``LlavaOnevisionImageProcessorPil`` and chat template: each image placeholder expanded to the image's
    token count by LlavaOnevisionProcessor's own ``replace_image_token`` / ``_get_number_of_features`` (called
    on this object), as its ``__call__`` does. Used only where the full processor cannot be built: transformers
    5.23's LlavaOnevisionProcessor requires a video processor, which requires torchvision."""

    def __init__(self, tokenizer: Any, image_processor: Any, *, num_image_tokens: int,
                 vision_feature_select_strategy: str = "full", vision_aspect_ratio: str = "anyres_max_9",
                 chat_template: str | None = None, image_token: str = "<image>", video_token: str = "<video>") -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.num_image_tokens = int(num_image_tokens)
        self.vision_feature_select_strategy = vision_feature_select_strategy
        self.vision_aspect_ratio = vision_aspect_ratio
        self.chat_template = chat_template or tokenizer.chat_template
        self.image_token = getattr(tokenizer, "image_token", None) or image_token
        self.video_token = video_token

    @classmethod
    def from_pretrained(cls, path: str) -> "AnyresImageTokenProcessor":
        """A checkpoint directory's tokenizer, image processor, chat template (``chat_template.jinja``, the older
        ``chat_template.json`` or the tokenizer's) and processor settings (``processor_config.json``, else what
        ``config.json`` implies: (image_size / patch_size)^2 tokens per crop)."""
        from transformers import AutoTokenizer
        from transformers.models.llava_onevision import LlavaOnevisionImageProcessorPil

        p = Path(path)
        settings = json.loads((p / "processor_config.json").read_text()) if (p / "processor_config.json").is_file() \
            else {}
        cfg = json.loads((p / "config.json").read_text()) if (p / "config.json").is_file() else {}
        vision = cfg.get("vision_config") or {}
        if "num_image_tokens" not in settings:
            settings["num_image_tokens"] = (vision.get("image_size", 384) // vision.get("patch_size", 14)) ** 2
        template = None
        if (p / "chat_template.jinja").is_file():
            template = (p / "chat_template.jinja").read_text()
        elif (p / "chat_template.json").is_file():
            template = json.loads((p / "chat_template.json").read_text()).get("chat_template")
        return cls(AutoTokenizer.from_pretrained(path), LlavaOnevisionImageProcessorPil.from_pretrained(path),
                   num_image_tokens=settings["num_image_tokens"],
                   vision_feature_select_strategy=settings.get("vision_feature_select_strategy",
                                                               cfg.get("vision_feature_select_strategy", "full")),
                   vision_aspect_ratio=settings.get("vision_aspect_ratio", cfg.get("vision_aspect_ratio",
                                                                                   "anyres_max_9")),
                   chat_template=template, image_token=settings.get("image_token", "<image>"),
                   video_token=settings.get("video_token", "<video>"))

    # transformers' own token count (LlavaOnevisionProcessor's methods read only the attributes set above)
    def replace_image_token(self, image_inputs: dict, image_idx: int) -> str:
        from transformers import LlavaOnevisionProcessor

        return LlavaOnevisionProcessor.replace_image_token(self, image_inputs, image_idx)

    def _get_number_of_features(self, orig_height: int, orig_width: int, height: int, width: int) -> int:
        from transformers import LlavaOnevisionProcessor

        return LlavaOnevisionProcessor._get_number_of_features(self, orig_height, orig_width, height, width)

    def _get_unpadded_features(self, *args: int) -> tuple[int, int]:
        from transformers import LlavaOnevisionProcessor

        return LlavaOnevisionProcessor._get_unpadded_features(self, *args)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def __call__(self, text: list[str], images: list[Any], return_tensors: str = "pt",
                 padding: bool | str = True) -> dict[str, Any]:
        img = self.image_processor(images=images, return_tensors=return_tensors)
        replacements = iter([self.replace_image_token(img, i) for i in range(len(images))])
        expanded = []
        for t in text:
            parts = t.split(self.image_token)
            out = parts[0]
            for rest in parts[1:]:
                out += next(replacements) + rest
            expanded.append(out)
        enc = self.tokenizer(expanded, return_tensors=return_tensors, padding=padding)
        return {**enc, "pixel_values": img["pixel_values"], "image_sizes": img["image_sizes"],
                "batch_num_images": img["batch_num_images"]}

    def save_pretrained(self, path: str | Path) -> None:
        """Tokenizer, image processor, chat template and the processor's settings, in llava-hf's file layout."""
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)
        if self.chat_template:
            (Path(path) / "chat_template.jinja").write_text(self.chat_template)
        (Path(path) / "processor_config.json").write_text(json.dumps({
            "processor_class": "LlavaOnevisionProcessor", "image_token": self.image_token,
            "video_token": self.video_token, "num_image_tokens": self.num_image_tokens,
            "vision_feature_select_strategy": self.vision_feature_select_strategy,
            "vision_aspect_ratio": self.vision_aspect_ratio}, indent=2) + "\n")


def onevision_tokenizer(texts: list[str]) -> Any:
    """The tiny word-level tokenizer with Qwen2's chat tokens and OneVision's template, made Qwen-like: no BOS
    is added and ``<|im_end|>`` ends a turn (eos)."""
    from tokenizers import processors

    from mcit.models.tiny_llava import train_tokenizer

    tok = train_tokenizer([*texts, "system user assistant"], extra_specials=SPECIALS,
                          chat_template=ONEVISION_TEMPLATE)
    tok.backend_tokenizer.post_processor = processors.Sequence([])
    tok.eos_token = "<|im_end|>"
    return tok


def build_llava_onevision(tokenizer: Any, *, image_size: int = 32, patch_size: int = 8, vision_hidden: int = 32,
                          text_hidden: int = 64, pinpoints: list[list[int]] | None = None,
                          vision_aspect_ratio: str = "anyres_max_2", chat_template: str = ONEVISION_TEMPLATE,
                          seed: int = 0) -> tuple[Any, AnyresImageTokenProcessor]:
    """A tiny LlavaOnevisionForConditionalGeneration (SigLIP without pooling head, Qwen2) from config classes and
    its offline processor over transformers' LlavaOnevisionImageProcessorPil, consistent with ``tokenizer``
    (image / video token ids, pad / bos / eos, vocabulary)."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )
    from transformers.models.llava_onevision import LlavaOnevisionImageProcessorPil

    pinpoints = [list(p) for p in (pinpoints or TINY_PINPOINTS)]
    eos = tokenizer.eos_token_id
    cfg = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                                         num_hidden_layers=2, num_attention_heads=2, image_size=image_size,
                                         patch_size=patch_size, vision_use_head=False),
        text_config=Qwen2Config(vocab_size=len(tokenizer), hidden_size=text_hidden, intermediate_size=2 * text_hidden,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, tie_word_embeddings=False),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=pinpoints, vision_aspect_ratio=vision_aspect_ratio, vision_feature_layer=-1,
        vision_feature_select_strategy="full", tie_word_embeddings=False,
    )
    cfg.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": image_size, "width": image_size},
                                                      image_grid_pinpoints=pinpoints, image_mean=[0.5] * 3,
                                                      image_std=[0.5] * 3)
    processor = AnyresImageTokenProcessor(tokenizer, image_processor, num_image_tokens=(image_size // patch_size) ** 2,
                                          vision_feature_select_strategy="full",
                                          vision_aspect_ratio=vision_aspect_ratio, chat_template=chat_template)
    return model, processor


@BACKBONES.register("llava_onevision")
class LlavaOnevisionBackbone(MLLMBackbone):
    """LLaVA-OneVision (LlavaOnevisionForConditionalGeneration)."""

    kind = "llava_onevision"
    model_class = "LlavaOnevisionForConditionalGeneration"
    model_types = ("llava_onevision",)
    unquantized = ("lm_head", ".*vision_tower", ".*multi_modal_projector")

    def __init__(self, model: nn.Module, processor: Any, max_length: int = 2048,
                 chat_format: str = "processor") -> None:
        super().__init__(model, processor, max_length, chat_format)
        cfg = model.config
        # plain attributes: the collate runs on ``collation_view()``, which has no model
        self.grid_pinpoints = [list(p) for p in cfg.image_grid_pinpoints]
        self.crop_size = int(cfg.vision_config.image_size)
        self.max_patches = 1 + max(math.ceil(h / self.crop_size) * math.ceil(w / self.crop_size)
                                   for h, w in self.grid_pinpoints)  # the base crop and the largest grid

    @classmethod
    def tiny(cls, texts: list[str], seed: int = 0) -> tuple[nn.Module, Any]:
        return build_llava_onevision(onevision_tokenizer(texts), seed=seed)

    @classmethod
    def offline_processor(cls, path: str) -> Any:
        return AnyresImageTokenProcessor.from_pretrained(path)  # no torchvision: no video processor

    # -- data -----------------------------------------------------------------------------------
    def render(self, turns: list[tuple[str, str]], *, train: bool, has_image: bool) -> Any:
        """The published template as it is: a training sample is its rendering of the whole conversation, an
        evaluation prompt its rendering with the generation prompt. (The base's renderer needs the generation
        prompt "<|im_start|>assistant\\n" to prefix the assistant turn, which this template writes as
        "<|im_start|>assistant \\n...".) Trained on: each answer and the ``<|im_end|>`` right after it."""
        from mcit.models import chat

        if self.chat_format != "processor" or getattr(self.processor, "chat_template", None) is None:
            return super().render(turns, train=train, has_image=has_image)

        def text(upto: int, with_answer: bool, gen: bool = False) -> str:
            msgs = chat.messages(turns, upto, has_image, with_answer)
            return self.processor.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)

        last = len(turns) - 1
        if not train:
            return chat.Rendered([(text(last, False, gen=True), False)])
        ends = [t for t in (self.tokenizer.eos_token, "<|im_end|>") if t]
        full = text(last, True)
        r = chat.Rendered()
        done = 0
        for i, (_, answer) in enumerate(turns):
            before, upto = text(i, False), text(i, True)
            if not (full.startswith(upto) and upto.startswith(before) and len(before) >= done):
                raise ValueError("the chat template does not render a conversation's turns as prefixes of each other")
            tail = upto[len(before):]  # this turn's assistant message: header, answer, end-of-turn token
            found = [(tail.rfind(answer + e), len(answer + e)) for e in ends if answer + e in tail]
            if not found:
                raise ValueError(f"the chat template does not end the answer {answer!r} with one of {ends}")
            start, end = len(before) + found[0][0], len(before) + sum(found[0])
            r.pieces += [(full[done:start], False), (full[start:end], True)]
            done = end
        if full[done:]:
            r.pieces.append((full[done:], False))
        return r

    def image_outputs(self, enc: dict) -> list[dict[str, Any]]:
        """Each image's own patches (the processor pads them to the batch's most; transformers' model counts the
        real ones from the image's size, as here) and its original size."""
        from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

        out = []
        for row, size in enumerate(enc["image_sizes"]):
            n = image_size_to_num_patches(size, self.grid_pinpoints, self.crop_size)
            out.append({"pixel_values": enc["pixel_values"][row, :n], "image_sizes": size})
        return out

    def row_pixels(self, enc: dict, has_image: bool) -> Any:
        """(this image's patches, its original (H, W)); a text-only row has neither."""
        return (enc["pixel_values"], enc["image_sizes"]) if has_image else (None, None)

    def batch_pixels(self, rows: list[Any], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, the batch's most patches, 3, H, W): each row's patches, zero-padded; ``image_patches`` (B,) the real
        count (``real_pixels``)
        (0: a text-only row, whose patches are all zero: LLaVA's blank image), ``image_sizes`` (B, 2)."""
        first = next((p for p, _ in rows if p is not None), None)
        shape, dtype = ((first.shape[1:], first.dtype) if first is not None
                        else ((3, self.crop_size, self.crop_size), torch.float32))
        n = max([1] + [len(p) for p, _ in rows if p is not None])
        pix = torch.zeros(len(rows), n, *shape, dtype=dtype)
        sizes = torch.zeros(len(rows), 2, dtype=torch.long)
        counts = torch.zeros(len(rows), dtype=torch.long)
        for i, (p, s) in enumerate(rows):
            if p is not None:
                if len(p) > self.max_patches:
                    raise ValueError(f"{len(p)} patches for an image; the pinpoints allow {self.max_patches}")
                pix[i, : len(p)] = p
                sizes[i] = torch.as_tensor(s)
                counts[i] = len(p)
        inputs["image_sizes"], inputs["image_patches"] = sizes, counts
        return pix

    def real_pixels(self, batch: Batch, row: int) -> torch.Tensor:
        return batch.pixel_values[row, : max(1, int(batch.inputs["image_patches"][row]))]

    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        """transformers' own inputs: the image rows' patches (padded to their most, as the processor pads a
        batch) and original sizes."""
        has = self.image_rows(batch)
        out = {"input_ids": batch.inputs["input_ids"], "attention_mask": batch.inputs["attention_mask"]}
        if bool(has.any()):
            n = int(batch.inputs["image_patches"][has].max())
            out["pixel_values"] = batch.pixel_values[has][:, :n].to(self.dtype)
            out["image_sizes"] = batch.inputs["image_sizes"][has]
        return out

    # -- compute --------------------------------------------------------------------------------
    def vision(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the packed image features of the rows with an image (N, d): transformers' ``get_image_features``, one
        tower pass over their real patches; each row's pooled query (B, dv): the tower's mean output token over
        the row's base crop, the whole image resized). A text-only row's query is that of a zero image, as LLaVA's
        training runs its blank image through the tower."""
        has = self.image_rows(batch)
        B = batch.pixel_values.shape[0]
        tower = self.model.model.vision_tower
        pooled = torch.zeros(B, self.image_query_dim, dtype=self.dtype, device=batch.pixel_values.device)
        feats = pooled.new_zeros(0, self.hidden_size)
        if bool(has.any()):
            counts = batch.inputs["image_patches"][has]
            out = self.model.model.get_image_features(
                pixel_values=batch.pixel_values[has][:, : int(counts.max())].to(self.dtype),
                image_sizes=batch.inputs["image_sizes"][has], return_dict=True)
            feats = torch.cat(list(out.pooler_output))
            base = torch.cat([counts.new_zeros(1), counts.cumsum(0)[:-1]])  # each image's first (base) patch
            pooled[has] = out.last_hidden_state[base].mean(1).to(pooled.dtype)
        if not bool(has.all()):
            blank = batch.pixel_values[~has][:1, 0].to(self.dtype).zero_()
            pooled[~has] = tower(blank).last_hidden_state.mean(1).to(pooled.dtype)
        return feats, pooled
