"""InternVL in transformers' own layout (``InternVLForConditionalGeneration``: OpenGVLab/InternVL3-*-hf).

Its own:

* tiling: the processor cuts each image into a grid of tiles whose aspect ratio is closest to the image's
  (GotOcr2's ``crop_to_patches``: at most ``max_patches`` tiles, plus a thumbnail of the whole image when there is
  more than one), so one image is several tiles and ``pixel_values`` is (tiles of the whole batch, 3, H, W). A
  batch row here carries its own tiles, padded to the batch's most, and ``inputs["num_tiles"]`` says how many
  are real (0: a text-only row);
* the text: an image is ``<img>`` + ``<IMG_CONTEXT>`` x (tokens per tile x tiles) + ``</img>``; the published
  template writes one ``<IMG_CONTEXT>`` per image, which the processor expands (``InternVLProcessor``);
* the features: transformers' ``get_image_features`` (the tower's patch tokens without its CLS, pixel shuffle by
  ``downsample_ratio``, the MLP projector); the tower has no pooled output, so the pooled image query is the mean
  of the image's projected tokens over all its tiles (LLM width), as Qwen2-VL's;
* an offline processor: transformers 5.23's InternVLProcessor needs a video processor, which needs torchvision.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mcit.core.registry import BACKBONES
from mcit.data.types import Batch
from mcit.models.mllm import MLLMBackbone

# OpenGVLab/InternVL3-1B-hf's chat template (chat_template.jinja; written by transformers'
# models/internvl/convert_internvl_weights_to_hf.py): ChatML, no default system turn, one <IMG_CONTEXT> per image.
INTERNVL_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
# The tokenizer's named tokens InternVLProcessor reads (the -hf checkpoints' tokenizer_config extra_special_tokens).
IMAGE_SPECIALS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                  "video_token": "<video>"}
CHATML = {"pad": "<|endoftext|>", "start": "<|im_start|>", "eos": "<|im_end|>"}


def max_tiles(image_processor: Any) -> int:
    """The most tiles one image can give: ``max_patches`` and the thumbnail (GotOcr2's crop_image_to_patches, with
    InternVLProcessor's crop_to_patches)."""
    from transformers import InternVLProcessor

    crop = InternVLProcessor.images_kwargs.get("crop_to_patches", image_processor.crop_to_patches)
    return image_processor.max_patches + 1 if crop and image_processor.max_patches > 1 else 1


class InternVLImageTokenProcessor:
    """The part of InternVLProcessor the wrapper uses, from a checkpoint's tokenizer and GotOcr2's PIL image
    processor: the images tiled as InternVLProcessor asks (its ``images_kwargs``: ``crop_to_patches``) and each
    image placeholder expanded to ``<img>`` + ``<IMG_CONTEXT>`` x (image_seq_length x tiles) + ``</img>``.
    Outputs what InternVLProcessor outputs: ids, mask, every image's tiles one after another."""

    def __init__(self, tokenizer: Any, image_processor: Any, image_seq_length: int = 256,
                 chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_seq_length = int(image_seq_length)
        self.chat_template = chat_template or tokenizer.chat_template
        self.start_image_token, self.end_image_token = tokenizer.start_image_token, tokenizer.end_image_token
        self.start_image_token_id = tokenizer.start_image_token_id
        self.end_image_token_id = tokenizer.end_image_token_id
        self.image_token, self.image_token_id = tokenizer.context_image_token, tokenizer.context_image_token_id

    @classmethod
    def from_pretrained(cls, path: str) -> "InternVLImageTokenProcessor":
        from transformers import AutoTokenizer
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        p = Path(path)
        template = None
        if (p / "chat_template.jinja").is_file():
            template = (p / "chat_template.jinja").read_text()
        elif (p / "chat_template.json").is_file():
            template = json.loads((p / "chat_template.json").read_text()).get("chat_template")
        seq = 256  # InternVLProcessor's default
        for name in ("processor_config.json", "config.json"):
            if (p / name).is_file() and "image_seq_length" in (cfg := json.loads((p / name).read_text())):
                seq = cfg["image_seq_length"]
                break
        return cls(AutoTokenizer.from_pretrained(path), GotOcr2ImageProcessorPil.from_pretrained(path), seq, template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def tiles(self, images: list[Any], return_tensors: str = "pt") -> Any:
        """GotOcr2's tiles of each image with InternVLProcessor's image defaults (crop_to_patches=True, whatever
        the checkpoint's preprocessor_config says): ``pixel_values`` and ``num_patches`` per image."""
        from transformers import InternVLProcessor

        return self.image_processor(images=images, return_tensors=return_tensors, **InternVLProcessor.images_kwargs)

    def __call__(self, text: list[str], images: list[Any], return_tensors: str = "pt",
                 padding: bool | str = True) -> dict[str, torch.Tensor]:
        from transformers import InternVLProcessor

        img = self.tiles(images, return_tensors)
        counts = [int(n) for n in img["num_patches"]]
        placeholder = re.compile(re.escape(self.image_token))
        if sum(len(placeholder.findall(t)) for t in text) != len(counts):
            raise ValueError(f"{len(counts)} images for {sum(len(placeholder.findall(t)) for t in text)} "
                             f"{self.image_token} placeholders")
        it = iter(counts)
        expanded = [placeholder.sub(lambda _: self.start_image_token + self.image_token * self.image_seq_length
                                    * next(it) + self.end_image_token, t) for t in text]
        # InternVLProcessor's text default (left padding) unless the tokenizer was built with its own side
        side = (self.tokenizer.padding_side if "padding_side" in self.tokenizer.init_kwargs
                else InternVLProcessor.text_kwargs["padding_side"])
        enc = self.tokenizer(expanded, return_tensors=return_tensors, padding=padding, padding_side=side)
        return {**enc, "pixel_values": img["pixel_values"]}

    def save_pretrained(self, path: str | Path) -> None:
        """tokenizer, image processor, template and processor_config.json as a -hf checkpoint has them (with
        torchvision, AutoProcessor builds transformers' InternVLProcessor from the same directory)."""
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)
        if self.chat_template:
            (Path(path) / "chat_template.jinja").write_text(self.chat_template)
        (Path(path) / "processor_config.json").write_text(json.dumps(
            {"image_seq_length": self.image_seq_length, "processor_class": "InternVLProcessor"}, indent=2))


def internvl_tokenizer(texts: list[str]) -> Any:
    """A word-level tokenizer trained on ``texts`` (mcit's ``train_tokenizer``) with InternVL3's token roles:
    ChatML (``<|im_end|>`` ends a turn and is EOS, ``<|endoftext|>`` pads, no BOS: Qwen2.5's), the image tokens
    as named special tokens, and the published chat template."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from mcit.models.tiny_llava import train_tokenizer

    words = "user assistant system"  # the template's own words
    base = train_tokenizer(list(texts) + [words], image_token_attribute=False,
                           extra_specials=tuple(CHATML.values()) + tuple(IMAGE_SPECIALS.values()),
                           chat_template=INTERNVL_TEMPLATE)
    raw = base.backend_tokenizer
    raw.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B", special_tokens=[])  # no BOS
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=CHATML["eos"], pad_token=CHATML["pad"],
                                   unk_token=base.unk_token, padding_side="right", chat_template=INTERNVL_TEMPLATE,
                                   extra_special_tokens=dict(IMAGE_SPECIALS))


def build_internvl(tokenizer: Any, *, tile: int = 16, patch: int = 4, max_patches: int = 4, vision_hidden: int = 32,
                   text_hidden: int = 64, seed: int = 0) -> tuple[nn.Module, InternVLImageTokenProcessor]:
    """A tiny InternVL (InternViT tower, pixel shuffle 0.5, MLP projector, Qwen2 LLM) from config classes and its
    processor. 16-pixel tiles: the benchmark's 32x32 images are 2x2 tiles + a thumbnail, so every sample is
    tiled; (tile / patch)^2 x 0.5^2 = 4 tokens per tile."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig, Qwen2Config
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    seq = (tile // patch) ** 2 // 4
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    cfg = InternVLConfig(
        vision_config=InternVLVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                                           num_hidden_layers=2, num_attention_heads=2, image_size=tile,
                                           patch_size=patch),
        text_config=Qwen2Config(vocab_size=len(tokenizer), hidden_size=text_hidden, intermediate_size=2 * text_hidden,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=512, pad_token_id=pad, bos_token_id=pad, eos_token_id=eos,
                                tie_word_embeddings=True),
        image_token_id=tokenizer.context_image_token_id, image_seq_length=seq, downsample_ratio=0.5,
        vision_feature_layer=-1, vision_feature_select_strategy="default", projector_hidden_act="gelu",
    )
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(cfg)
    model.generation_config.pad_token_id = pad
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id = pad
    image_processor = GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, crop_to_patches=False,
                                               min_patches=1, max_patches=max_patches,
                                               image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    return model, InternVLImageTokenProcessor(tokenizer, image_processor, seq, INTERNVL_TEMPLATE)


@BACKBONES.register("internvl")
class InternVLBackbone(MLLMBackbone):
    """InternVL in transformers' layout (InternVLForConditionalGeneration)."""

    kind = "internvl"
    model_class = "InternVLForConditionalGeneration"
    model_types = ("internvl",)
    unquantized = ("lm_head", ".*vision_tower", ".*multi_modal_projector")

    @classmethod
    def tiny(cls, texts: list[str], seed: int = 0) -> tuple[nn.Module, Any]:
        return build_internvl(internvl_tokenizer(texts), seed=seed)

    @classmethod
    def offline_processor(cls, path: str) -> Any:
        return InternVLImageTokenProcessor.from_pretrained(path)  # no torchvision: no video processor

    def pooled_image_dim(self) -> int:
        """No pooled output in the tower: the query is the image's mean projected token, of the LLM's width."""
        return self.hidden_size

    # -- data -----------------------------------------------------------------------------------
    def max_tiles(self) -> int:
        """The most tiles an image can give (what every row is padded to)."""
        return max_tiles(self.processor.image_processor)

    def image_outputs(self, enc: dict) -> list[dict[str, Any]]:
        """pixel_values are every image's tiles, one after another (one image per row here): a row's tile count
        is its ``<IMG_CONTEXT>`` count over the tokens per tile, as the processor wrote them."""
        seq = int(self.processor.image_seq_length)
        counts = (enc["input_ids"] == self.image_token_id).sum(1).tolist()
        if any(c % seq for c in counts) or sum(counts) // seq != enc["pixel_values"].shape[0]:
            raise ValueError(f"{counts} image tokens ({seq} a tile) for {enc['pixel_values'].shape[0]} tiles")
        tiles = torch.split(enc["pixel_values"], [c // seq for c in counts])
        return [{"pixel_values": t} for t in tiles]

    def image_tokens(self, ids: list[int], flags: list[bool], turns: list[tuple[str, str]], has_image: bool,
                     extra: dict) -> tuple[list[int], list[bool], dict]:
        """The template's ``<IMG_CONTEXT>`` becomes ``<img><IMG_CONTEXT></img>`` (the base expands the middle
        to the image's tokens), as InternVLProcessor writes an image."""
        start, end = int(self.processor.start_image_token_id), int(self.processor.end_image_token_id)
        out_ids, out_flags = [], []
        for t, f in zip(ids, flags):
            if t == self.image_token_id:
                out_ids += [start, t, end]
                out_flags += [False] * 3
            else:
                out_ids.append(t)
                out_flags.append(f)
        return out_ids, out_flags, extra

    def row_pixels(self, enc: dict, has_image: bool) -> Any:
        """This image's tiles; a text-only row has none."""
        return enc["pixel_values"] if has_image else None

    def batch_pixels(self, rows: list[Any], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, the batch's most tiles, 3, H, W): each row's tiles, zero-padded; ``inputs["num_tiles"]`` says how
        many are real (``real_pixels``)."""
        size = self.processor.image_processor.size
        shape = (3, size["height"], size["width"])
        n = max([1] + [r.shape[0] for r in rows if r is not None])
        inputs["num_tiles"] = torch.tensor([0 if r is None else r.shape[0] for r in rows], dtype=torch.long)
        return torch.stack([torch.zeros(n, *shape) if r is None else torch.cat([r, r.new_zeros(n - r.shape[0], *shape)])
                            for r in rows])

    def real_pixels(self, batch: Batch, row: int) -> torch.Tensor:
        return batch.pixel_values[row, : int(batch.inputs["num_tiles"][row])]

    def _real_tiles(self, batch: Batch) -> tuple[list[int], list[int], torch.Tensor | None]:
        """(rows with an image, their tile counts, their real tiles one after another, as transformers takes them)."""
        has = self.image_rows(batch)
        rows = has.nonzero().flatten().tolist()
        counts = [int(batch.inputs["num_tiles"][i]) for i in rows]
        if not rows:
            return rows, counts, None
        return rows, counts, torch.cat([batch.pixel_values[i, :c] for i, c in zip(rows, counts)]).to(self.dtype)

    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        """transformers' own inputs: ids, mask and every image row's real tiles one after another."""
        out = {"input_ids": batch.inputs["input_ids"], "attention_mask": batch.inputs["attention_mask"]}
        _, _, tiles = self._real_tiles(batch)
        if tiles is not None:
            out["pixel_values"] = tiles
        return out

    # -- compute --------------------------------------------------------------------------------
    def vision(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the projected tokens of every image row's tiles, in row then tile order: (tiles, tokens a tile, d);
        each row's mean projected token over all its tiles, zero for a text-only row). InternVLVisionModel
        computes no pooled output (its CLS token is dropped before the projector, so the LLM never read it):
        the mean of what the LLM reads is the image's natural summary."""
        rows, counts, tiles = self._real_tiles(batch)
        pooled = torch.zeros(batch.pixel_values.shape[0], self.image_query_dim, dtype=self.dtype,
                             device=batch.pixel_values.device)
        if tiles is None:
            return pooled.new_zeros(0, 1, self.hidden_size), pooled
        feats = self.model.model.get_image_features(pixel_values=tiles, return_dict=True).pooler_output
        for i, part in zip(rows, torch.split(feats, counts)):
            pooled[i] = part.reshape(-1, part.shape[-1]).mean(0).to(pooled.dtype)
        return feats, pooled

    @torch.no_grad()
    def text_query(self, batch: Batch, embeds: torch.Tensor) -> torch.Tensor:
        """The base's mean instruction embedding, ``<img>`` / ``</img>`` left out with the image tokens."""
        ids = batch.inputs["input_ids"]
        marks = (ids == int(self.processor.start_image_token_id)) | (ids == int(self.processor.end_image_token_id))
        m = (batch.inputs["attention_mask"].bool() & (ids != self.image_token_id) & ~marks
             & (batch.labels == -100)).to(embeds.dtype).unsqueeze(-1)
        return (embeds * m).sum(1) / m.sum(1).clamp_min(1)
