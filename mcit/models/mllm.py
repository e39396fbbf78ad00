"""Frozen multimodal LLMs behind one wrapper, through transformers' own model classes.

``MLLMBackbone`` turns instruction samples (an image and a LLaVA-style conversation) into batches
through the checkpoint's own processor and chat template, builds the LLM's *input embeddings*
(token embeddings with the projected image features written over the image tokens), and runs the
frozen language model on embeddings that a method may have extended with prompts: a per-sample
answer-token loss for training and batched greedy generation with the KV cache for evaluation.

Prompts go after any left padding and before the first real token, so a sample's positions (and
its answer) are the same whatever else is in its batch.

The base has no family branch: what differs between model families (their transformers class, the
processor and its offline fallback, the vision features and the pooled image query, position ids, how image
tokens enter the text) is a method a family overrides, one file per family: ``llava.py`` (LLaVA / LLaVA-1.5,
llava-hf), ``instructblip.py`` (InstructBLIP with a decoder-only LLM), ``qwen2_vl.py`` (Qwen2-VL). The defaults
are llava-hf's. The model is frozen and in eval mode; bf16 on GPU (``train.precision``), fp32 on CPU;
optional 4-bit / 8-bit loading of the frozen weights through bitsandbytes.
"""

from __future__ import annotations

import array
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from mcit.core.registry import BACKBONES
from mcit.data.types import Batch
from mcit.models.base import (
    Backbone,
    BackboneError,
    check_hf_dir,
    check_model_type,
    check_weights,
    strict_from_pretrained,
)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_source(path: str, family: type | None = None) -> None:
    """A local HF directory (config.json present, of ``family``'s model_type where given) or, where the directory
    does not exist, a hub id (pre-flight lets one through only with ``backbone.hub: true``)."""
    p = Path(path)
    if p.exists():
        if not (p / "config.json").is_file():
            raise BackboneError(f"backbone path {path} has no config.json (not a transformers checkpoint directory)")
        if family is not None:
            check_model_type(family, path, check_hf_dir(path))
        return
    if not HUB_ID.match(path):
        raise BackboneError(f"backbone path not found: {path}")


def quantization_config(mode: str, dtype: torch.dtype, keep: tuple[str, ...] = ("lm_head",)) -> Any:
    """BitsAndBytesConfig for a 4-bit (nf4, double quant) or 8-bit frozen backbone; modules whose names
    contain an entry of ``keep`` stay in ``dtype``. A clear error where bitsandbytes is missing."""
    if mode == "none":
        return None
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except Exception as e:  # noqa: BLE001
        raise BackboneError(f"backbone.quantization={mode} needs bitsandbytes, which cannot be imported here "
                            f"({e.__class__.__name__}: {e})") from None
    if mode == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=list(keep))
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=list(keep))


def answer_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal LM's cross-entropy of each answer token (``labels`` not -100, shifted by one as the model
    predicts the next token), in float32: (B,) sums per sample and (B,) token counts. Their total over the
    batch divided by the total count is LLaVA's ``LlavaLlamaForCausalLM.forward`` loss (CrossEntropyLoss's mean
    over every answer token of the micro-batch)."""
    logits = logits[:, :-1].float()
    target = labels[:, 1:]
    ce = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                     ignore_index=-100, reduction="none").view(target.shape)
    return ce.sum(1), (target != -100).sum(1)


class PromptMemo(dict):
    """A per-process memo of the collate (``MLLMBackbone._encode_one``'s tokens per conversation, an image
    shape's token count). It pickles empty: a collate's view of the backbone
    (``collation_view``) goes to the loader workers in kilobytes, and its registry digest does not change as the
    memo fills."""

    def __reduce__(self) -> tuple:
        return (PromptMemo, ())


class MLLMBackbone(Backbone):
    """A frozen multimodal LLM and its processor. A family (one file: ``LlavaBackbone``, ``InstructBlipBackbone``,
    ``Qwen2VLBackbone``) names its transformers class and overrides the hooks below where it differs from
    llava-hf. ``MLLMBackbone.from_path`` / ``MLLMBackbone.wrap`` pick the family from the checkpoint or model."""

    task_type = "generation"
    load_options = ("quantization", "max_length", "chat_format")
    # A conversation's tokens (chat template + tokenizer: a pure function of the turns) are kept for this many
    # distinct conversations per process: benchmarks ask the same instruction many times (the embedded one 120
    # phrasings per task over 600 questions), and these two were a third of an evaluation's collation.
    PROMPT_MEMO = 4096
    # The processor's image outputs and token count do not depend on the text (``encode_batch``); a family sets
    # it where a test shows its collate equal to the full processor's.
    images_alone = False
    hub_ids = True
    kind: str = ""  # the family's backbone.kind
    model_class: str = ""  # its transformers class
    model_types: tuple[str, ...] = ()  # config.json model_type values it loads
    # What ``backbone.quantization`` leaves unquantized: the output head and the vision side (tower, Q-Former,
    # projector), as LLaVA's own 4/8-bit loader does (it quantizes the language model only). bitsandbytes'
    # packed CPU 4-bit kernels also need in_features >= their 64-wide blocks. (transformers matches each entry
    # from the start of a module's full name, as a regex, or as a suffix.)
    unquantized: tuple[str, ...] = ("lm_head",)
    # The module that maps vision features into the LLM's space (what LLaVA calls the mm_projector), as a path in
    # the transformers model: the LoRA family trains it where ``method.train_projector`` is set.
    projector_path: str = "model.multi_modal_projector"

    def __init__(self, model: nn.Module, processor: Any, max_length: int = 2048,
                 chat_format: str = "processor") -> None:
        super().__init__()
        from mcit.models.chat import CHAT_FORMATS

        if chat_format not in CHAT_FORMATS:
            raise BackboneError(f"backbone.chat_format: unknown format {chat_format!r}; "
                                f"known: {', '.join(CHAT_FORMATS)}")
        if type(model).__name__ != self.model_class:
            raise BackboneError(f"{type(self).__name__} wraps {self.model_class or 'no model class'}, not "
                                f"{type(model).__name__} (MLLMBackbone.wrap picks the family)")
        self.validate(model)
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer if processor is not None else None  # None: shapes-only use
        self.max_length = max_length
        self.chat_format = chat_format
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.model.eval()
        cfg = model.config
        tok_id = getattr(cfg, "image_token_index", None)
        self.image_token_id = int(tok_id if tok_id is not None else cfg.image_token_id)
        self.hidden_size = int(cfg.text_config.hidden_size)
        self.output_vocab = self._output_vocab(model)
        self.image_query_dim = self.pooled_image_dim()
        self.text_query_dim = self.hidden_size

    def _output_vocab(self, model: nn.Module) -> int | None:
        """The ids LLaVA-1.5's own model predicts (``chat_format: vicuna_v1``: run as the original LLaVA): Vicuna's
        vocabulary, ``tokenizer.vocab_size``. llava-hf's checkpoints and ``data_prep.convert_llava`` add ``<image>``,
        ``<pad>`` and padding rows to a multiple of 64 after it; the original model has no such outputs (it splices
        image features at index -200). Their logits would enter the softmax and move the loss (on the
        SentencePiece fixture, 20 added rows of 320: the answer tokens' cross-entropy by 0.8%), so ``logits`` masks
        them and generation never picks them. None where nothing is masked."""
        base = getattr(self.tokenizer, "vocab_size", None)
        rows = int(model.config.text_config.vocab_size)
        if self.kind == "llava" and self.chat_format == "vicuna_v1" and base and int(base) < rows:
            return int(base)
        return None

    # -- the families ------------------------------------------------------------------------------
    @staticmethod
    def families() -> list[type["MLLMBackbone"]]:
        """Every registered family (the registry imports each ``mcit/models`` module once)."""
        BACKBONES.names()
        out, todo = [], list(MLLMBackbone.__subclasses__())
        while todo:
            c = todo.pop()
            todo += c.__subclasses__()
            if c.model_class and BACKBONES.get(c.kind) is c:
                out.append(c)
        return sorted(out, key=lambda c: c.kind)

    @classmethod
    def family(cls, *, model_class: str | None = None, model_type: str | None = None) -> type["MLLMBackbone"]:
        """This class where it is a family, else the family of a transformers class name or config model_type."""
        if cls.model_class:
            return cls
        for fam in MLLMBackbone.families():
            if model_class == fam.model_class or (model_type is not None and model_type in fam.model_types):
                return fam
        known = ", ".join(f"{f.kind} ({f.model_class})" for f in MLLMBackbone.families())
        raise BackboneError(f"unsupported multimodal model {model_class or model_type}; supported: {known}")

    @classmethod
    def wrap(cls, model: nn.Module, processor: Any, **kw: Any) -> "MLLMBackbone":
        """A loaded transformers model in its family's wrapper."""
        return cls.family(model_class=type(model).__name__)(model, processor, **kw)

    def validate(self, model: nn.Module) -> None:
        """A family's check of the model it is given (raise BackboneError); none by default."""

    def pooled_image_dim(self) -> int:
        """The width of the pooled image feature (the prompt methods' image query): the vision tower's."""
        return int(self.model.config.vision_config.hidden_size)

    @classmethod
    def check(cls, path: str) -> None:
        """A local HF directory whose weights fill the family's transformers class exactly (no weight read:
        ``check_weights``), or, where the directory does not exist, a hub id."""
        import transformers

        cls.check_files(path)
        if Path(path).is_dir():
            fam = cls.family(model_type=json.loads((Path(path) / "config.json").read_text()).get("model_type"))
            check_weights(getattr(transformers, fam.model_class), path)

    @classmethod
    def check_files(cls, path: str) -> None:
        """A local HF directory (config.json present, of this family) or, where the directory does not exist, a
        hub id."""
        check_model_source(path, cls)

    @classmethod
    def tiny(cls, texts: list[str], seed: int = 0) -> tuple[nn.Module, Any]:
        """A tiny model of the family built from its config classes (random weights from ``seed``) and its
        processor, with a tokenizer trained on ``texts``: what the family tests and the launcher runs load
        (``save_pretrained`` both into one directory). Every family provides one."""
        raise BackboneError(f"family {cls.kind or cls.__name__} defines no tiny model: a family implements "
                            f"MLLMBackbone.tiny (docs/architecture.md, adding a family)")

    @classmethod
    def offline_processor(cls, path: str) -> Any:
        """The processor where ``AutoProcessor`` cannot build it here (a family's fallback); None: none."""
        return None

    @classmethod
    def from_path(cls, path: str, dtype: torch.dtype = torch.float32, quantization: str = "none",
                  max_length: int = 2048, chat_format: str = "processor") -> "MLLMBackbone":
        import transformers
        from transformers import AutoProcessor

        cls.check_files(path)  # the load below is strict: no separate weight check
        fam = cls
        if not cls.model_class:  # the base: the family the checkpoint names
            p = Path(path) / "config.json"
            fam = cls.family(model_type=json.loads(p.read_text()).get("model_type") if p.is_file() else None)
        model_cls = getattr(transformers, fam.model_class)
        qc = quantization_config(quantization, dtype, fam.unquantized)
        try:
            try:
                processor = AutoProcessor.from_pretrained(path)
            except Exception:
                processor = fam.offline_processor(path)
                if processor is None:
                    raise
            kwargs: dict[str, Any] = {"dtype": dtype}
            if qc is not None:
                kwargs["quantization_config"] = qc
            model = strict_from_pretrained(model_cls, path, **kwargs)
        except BackboneError:
            raise
        except Exception as e:  # noqa: BLE001 - one line naming the path
            raise BackboneError(f"cannot load {fam.kind} backbone from {path}: {str(e).splitlines()[0]}") from None
        return fam(model, processor, max_length, chat_format)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def token_embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def projector(self) -> nn.Module:
        """The vision-to-LLM projector (``projector_path``)."""
        return self.model.get_submodule(self.projector_path)

    def set_projector(self, module: nn.Module) -> None:
        """Put ``module`` where the projector is (a method's trainable copy of it)."""
        parent, _, name = self.projector_path.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, name, module)

    @property
    def language_model(self) -> nn.Module:
        """The decoder-only LLM (where LoRA goes)."""
        return self.model.model.language_model

    @property
    def causal_lm(self) -> nn.Module:
        """What runs on input embeddings and returns logits / generates (LLaVA accepts embeddings alone)."""
        return self.model

    # -- data -----------------------------------------------------------------------------------
    def render(self, turns: list[tuple[str, str]], *, train: bool, has_image: bool) -> Any:
        """A sample's conversation in ``chat_format`` (mcit.models.chat), ending where the model answers
        when ``train`` is False."""
        from mcit.models import chat

        eos = self.tokenizer.eos_token
        if self.chat_format == "vicuna_v1":
            return chat.render_vicuna_v1(turns, train=train, has_image=has_image, eos=eos)
        if getattr(self.processor, "chat_template", None) is None:  # InstructBLIP: LAVIS' plain instruction
            return chat.render_plain(turns, train=train, eos=eos)
        ends = [t for t in (eos, "<|im_end|>", "<|eot_id|>", "<|end|>") if t]
        return chat.render_template(self.processor, turns, train=train, has_image=has_image, end_tokens=ends)

    def encode(self, turns: list[tuple[str, str]], image: Any, *, train: bool) -> tuple[list[int], list[int], dict]:
        """(input ids, labels, the processor's image outputs) of one sample: the image placeholder expanded
        to the image's tokens, labels -100 outside the answers and their end-of-turn tokens."""
        return self.encode_batch([(turns, image)], train=train)[0]

    def encode_batch(self, items: list[tuple[list[tuple[str, str]], Any]], *, train: bool
                     ) -> list[tuple[list[int], list[int], dict]]:
        """``encode`` of each (turns, image): the processor runs once over all the images (per-sample calls spent
        most of their time in its argument handling: 33 ms against 11 ms for 64 images of the embedded
        benchmark, the same pixel values; bench/eval_throughput.py), and its outputs are split per sample:
        ``pixel_values`` (Qwen2-VL: the image's patches), ``image_grid_thw``, ``qformer_input_ids`` (unpadded).
        A family whose image tokens depend on the image alone (``images_alone``: LLaVA) runs only the image
        processor, and counts an image's tokens once per pixel shape: the processor's text pass (placeholders
        expanded and tokenised only to be counted) was a fifth of an evaluation's collation (0.47 -> 0.375 s
        for the 2400 questions of bench/eval_throughput.py)."""

        with_image = [i for i, (_, image) in enumerate(items) if image is not None]
        per_image: dict[int, tuple[dict, int]] = {}
        if with_image and self.images_alone:
            images = [items[i][1] for i in with_image]
            enc = dict(self.processor.image_processor(images, return_tensors="pt"))
            enc["input_ids"] = torch.zeros(len(images), 0, dtype=torch.long)
            for row, (i, extra) in enumerate(zip(with_image, self.image_outputs(enc))):
                per_image[i] = (extra, self._image_token_count(images[row], extra))
        elif with_image:
            texts = [self.processor_text(items[i][0]) for i in with_image]
            enc = self.processor(text=texts, images=[items[i][1] for i in with_image], return_tensors="pt",
                                 padding=True)
            counts = (enc["input_ids"] == self.image_token_id).sum(1).tolist()
            for row, (i, extra) in enumerate(zip(with_image, self.image_outputs(enc))):
                per_image[i] = (extra, int(counts[row]))
        return [self._encode_one(turns, image, per_image.get(i), train=train) for i, (turns, image) in enumerate(items)]

    def _image_token_count(self, image: Any, extra: dict) -> int:
        """How many tokens the processor expands an image with these outputs into: the full processor's count for
        the first image of each output shape, kept per shape."""
        key = tuple((k, tuple(v.shape)) for k, v in sorted(extra.items()) if isinstance(v, torch.Tensor))
        counts = self.__dict__.get("_image_counts")
        if counts is None:
            counts = self.__dict__["_image_counts"] = PromptMemo()
        if key not in counts:
            enc = self.processor(text=[self._image_string()], images=[image], return_tensors="pt")
            counts[key] = int((enc["input_ids"] == self.image_token_id).sum())
        return counts[key]

    def image_outputs(self, enc: dict) -> list[dict[str, Any]]:
        """The processor's outputs for a batch of images, split per image (``pixel_values`` of each)."""
        return [{"pixel_values": enc["pixel_values"][row:row + 1]} for row in range(len(enc["input_ids"]))]

    def processor_text(self, turns: list[tuple[str, str]]) -> str:
        """The text the processor gets with a sample's image, to count the image's tokens: the placeholder."""
        return self._image_string()

    def image_tokens(self, ids: list[int], flags: list[bool], turns: list[tuple[str, str]], has_image: bool,
                     extra: dict) -> tuple[list[int], list[bool], dict]:
        """A family's change to a tokenised sample (ids, answer flags, image inputs) before the placeholder is
        expanded; none by default (the chat format put the placeholder where the family wants it)."""
        return ids, flags, extra

    def _encode_one(self, turns: list[tuple[str, str]], image: Any, processed: tuple[dict, int] | None, *,
                    train: bool) -> tuple[list[int], list[int], dict]:
        from mcit.models import chat

        has_image = image is not None
        key = (tuple(turns), has_image, train)
        memo = self.__dict__.get("_prompt_memo")
        if memo is None:
            memo = self.__dict__["_prompt_memo"] = PromptMemo()
        hit = memo.get(key)
        if hit is None:
            ids, flags = chat.tokenize(self.tokenizer, self.render(turns, train=train, has_image=has_image),
                                       self.image_token_id)
            if len(memo) >= self.PROMPT_MEMO:
                memo.pop(next(iter(memo)))
            memo[key] = (array.array("q", ids), bytes(bytearray(map(bool, flags))))  # 9 bytes a token, not ~40
        else:
            ids, flags = list(hit[0]), [bool(f) for f in hit[1]]
        extra: dict[str, Any] = {}
        n_image = 0
        if has_image:
            assert processed is not None
            extra, n_image = processed
        ids, flags, extra = self.image_tokens(ids, flags, turns, has_image, extra)
        out_ids, labels = [], []
        for t, f in zip(ids, flags):
            if t == self.image_token_id:
                if not has_image:
                    raise ValueError("an image placeholder in a sample without an image")
                out_ids += [t] * n_image
                labels += [-100] * n_image
            else:
                out_ids.append(t)
                labels.append(t if (train and f) else -100)
        return out_ids, labels, extra

    def _image_string(self) -> str:
        """What the processor expands into an image's tokens (llava-hf ``<image>``, Qwen ``<|image_pad|>``)."""
        tok = getattr(self.processor, "image_token", None)
        return str(getattr(tok, "content", tok) or "<image>")

    def _blank_pixels(self) -> torch.Tensor:
        """A zero image of the processor's size, for a text-only sample in a batch with images: LLaVA's own
        training does the same (``torch.zeros(3, crop_size)``) and inserts none of its features."""
        if getattr(self, "_blank", None) is None:
            from PIL import Image

            enc = self.processor(text=[self._image_string()], images=[Image.new("RGB", (32, 32))], return_tensors="pt")
            self._blank = torch.zeros_like(enc["pixel_values"][0])
        return self._blank

    def make_collate(self, split: Any, task: int, *, train: bool, label_index: dict[int, int] | None = None
                     ) -> Callable[..., Batch]:
        """Raw instruction samples -> Batch. Train: right padding, labels on the answers (every turn of a
        multi-turn conversation, with its history) and their end-of-turn tokens, -100 elsewhere. Eval: the
        prompt up to the last answer, left padding, references in ``meta``. Text-only samples have no image
        tokens; ``inputs["has_image"]`` says which rows do."""
        import functools

        return functools.partial(self.collation_view().collate, task=task, train=train,
                                 location=str(getattr(split, "location", "?")))

    def collate(self, samples: list[dict], seed: int | None = None, *, task: int, train: bool,
                location: str) -> Batch:
        """``make_collate``'s collate (``seed`` is unused: instruction samples are not augmented); a method, so
        that the collate bound to ``collation_view()`` pickles into the loader's workers."""
        from mcit.data.instructions import decode_instruction

        pad_id = int(self.tokenizer.pad_token_id)
        ids_list, lab_list, pix, keys, meta, has, encs = [], [], [], [], [], [], []
        decoded = [decode_instruction(s) for s in samples]
        encoded = self.encode_batch([(rec["turns"], image) for image, rec, _ in decoded], train=train)
        for (image, rec, key), (ids, labels, enc) in zip(decoded, encoded):
            if len(ids) > self.max_length:
                raise ValueError(f"sample {key} in {location}: {len(ids)} tokens "
                                 f"> backbone.max_length {self.max_length}")
            ids_list.append(ids)
            lab_list.append(labels)
            has.append(image is not None)
            encs.append(enc)
            pix.append(self.row_pixels(enc, image is not None))
            keys.append(key)
            meta.append({**{k: v for k, v in rec.items() if k != "turns"}, "key": key,
                         "first_question": rec["turns"][0][0] if rec.get("turns") else rec.get("question")})
        L = max(len(x) for x in ids_list)
        B = len(ids_list)
        rows_ids, rows_attn, rows_lab = [], [], []
        for ids, lab in zip(ids_list, lab_list):
            pad = L - len(ids)  # right padding to train, left to generate
            rows_ids.append(ids + [pad_id] * pad if train else [pad_id] * pad + ids)
            rows_attn.append([1] * len(ids) + [0] * pad if train else [0] * pad + [1] * len(ids))
            rows_lab.append(lab + [-100] * pad if train else [-100] * pad + lab)
        input_ids = torch.tensor(rows_ids, dtype=torch.long)
        attn = torch.tensor(rows_attn, dtype=torch.long)
        labels = torch.tensor(rows_lab, dtype=torch.long)
        inputs = {"input_ids": input_ids, "attention_mask": attn, "has_image": torch.tensor(has)}
        self.extra_inputs(encs, inputs)
        return Batch(self.batch_pixels(pix, inputs), labels, torch.ones(B), task, keys, inputs=inputs, meta=meta)

    def extra_inputs(self, encs: list[dict], inputs: dict[str, torch.Tensor]) -> None:
        """A family's batched inputs beyond ids, mask and pixels, from each row's encoding; none by default."""

    def row_pixels(self, enc: dict, has_image: bool) -> Any:
        """One row's pixel values from its processor outputs (a text-only row: the blank image)."""
        return enc["pixel_values"][0] if has_image else self._blank_pixels()

    def batch_pixels(self, rows: list[Any], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's pixel values from its rows' (a family may add to ``inputs``)."""
        return torch.stack(rows)

    def real_pixels(self, batch: Batch, row: int) -> torch.Tensor:
        """What row ``row`` of the batch's pixel values really holds: a family that pads rows to the batch's longest
        (patches, tiles) drops the padding here. A row is the same whatever its batch."""
        return batch.pixel_values[row]


    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        """The batch as transformers' own forward / ``generate`` of the model take it (ids with the image tokens
        expanded, mask, the image rows' pixels and the family's extras): the reference the wrapper's logits and
        generation are tested against, and a way to run the checkpoint without any method."""
        has = self.image_rows(batch)
        out = {"input_ids": batch.inputs["input_ids"], "attention_mask": batch.inputs["attention_mask"]}
        if bool(has.any()):
            out["pixel_values"] = batch.pixel_values[has].to(self.dtype)
        return out

    # -- compute --------------------------------------------------------------------------------
    def image_rows(self, batch: Batch) -> torch.Tensor:
        """Which rows of the batch carry an image (B,) bool."""
        has = batch.inputs.get("has_image")
        n = batch.pixel_values.shape[0]
        return torch.ones(n, dtype=torch.bool, device=batch.pixel_values.device) if has is None else has

    def vision(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(image features in the LLM's space of the rows with an image (n, N, d), pooled vision feature of
        every row (B, dv)), one tower pass. Text-only rows run their zero image through the tower as LLaVA's
        training does (its features are inserted nowhere)."""
        cfg = self.model.config
        pixel_values = batch.pixel_values
        has = self.image_rows(batch)
        tower = self.model.model.vision_tower
        out = tower(pixel_values.to(self.dtype), output_hidden_states=True)
        layer = cfg.vision_feature_layer
        if isinstance(layer, int):
            hidden = out.hidden_states[layer]
            if cfg.vision_feature_select_strategy == "default":
                hidden = hidden[:, 1:]
            feats = self.model.model.multi_modal_projector(hidden)
        else:  # several layers: defer to transformers' own implementation
            feats = torch.stack(list(self.model.model.get_image_features(pixel_values=pixel_values.to(self.dtype),
                                                                          return_dict=True).pooler_output))
        return feats[has], out.pooler_output

    def projector_trains(self) -> bool:
        """Whether a method put a trainable projector in (then the image features carry its gradients)."""
        return any(p.requires_grad for p in self.projector().parameters())

    def input_embeddings(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The LLM's multimodal input embeddings (B, L, d) and the pooled image feature (B, dv); without gradients
        unless the projector trains (the frozen tower then builds no graph: none of its inputs needs one)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.projector_trains()):
            return self._input_embeddings(batch)

    def _input_embeddings(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        ids = batch.inputs["input_ids"]
        embeds = self.model.get_input_embeddings()(ids)
        feats, pooled = self.vision(batch)
        mask = ids == self.image_token_id
        n_feats = feats.numel() // feats.shape[-1]
        if int(mask.sum()) != n_feats:
            raise ValueError(f"batch {batch.keys[:3]}: {int(mask.sum())} image tokens for {n_feats} image features "
                             f"(processor and model config disagree)")
        embeds = embeds.masked_scatter(mask.unsqueeze(-1), feats.reshape(-1, feats.shape[-1]).to(embeds.dtype))
        return embeds, pooled

    @torch.no_grad()
    def text_query(self, batch: Batch, embeds: torch.Tensor) -> torch.Tensor:
        """The instruction's text feature: mean of its frozen token embeddings (image tokens and padding
        excluded). LLaVA has no text encoder of its own; the frozen LLM embeddings play that role."""
        ids = batch.inputs["input_ids"]
        m = (batch.inputs["attention_mask"].bool() & (ids != self.image_token_id)
             & (batch.labels == -100)).to(embeds.dtype).unsqueeze(-1)
        return (embeds * m).sum(1) / m.sum(1).clamp_min(1)

    @torch.no_grad()
    def positions(self, batch: Batch) -> torch.Tensor | None:
        """Explicit position ids of the batch's tokens (a family with its own, e.g. M-RoPE); None: the
        model's default positions."""
        return None

    @staticmethod
    def insert_prompts(embeds: torch.Tensor, attention_mask: torch.Tensor, prompts: torch.Tensor | None,
                       labels: torch.Tensor | None = None, positions: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Put ``prompts`` (B, P, d) right before each row's first real token (after left padding).
        With explicit ``positions`` (3, B, L), the prompts take the first real token's position onwards
        and every later token moves P positions on."""
        if prompts is None or prompts.shape[1] == 0:
            return embeds, attention_mask, labels, positions
        B, P = prompts.shape[:2]
        first = (attention_mask.cumsum(1) == 0).sum(1)  # number of leading pads per row
        rows, masks, labs, poss = [], [], [], []
        one = attention_mask.new_ones(P)
        for i in range(B):
            f = int(first[i])
            rows.append(torch.cat([embeds[i, :f], prompts[i].to(embeds.dtype), embeds[i, f:]]))
            masks.append(torch.cat([attention_mask[i, :f], one, attention_mask[i, f:]]))
            if labels is not None:
                labs.append(torch.cat([labels[i, :f], labels.new_full((P,), -100), labels[i, f:]]))
            if positions is not None:
                p = positions[:, i]
                start = p[:, f:f + 1] if f < p.shape[1] else p[:, -1:] + 1
                poss.append(torch.cat([p[:, :f], start + torch.arange(P, device=p.device), p[:, f:] + P], 1))
        return (torch.stack(rows), torch.stack(masks), (torch.stack(labs) if labels is not None else None),
                (torch.stack(poss, 1) if positions is not None else None))

    def logits(self, embeds: torch.Tensor, attention_mask: torch.Tensor, positions: Any = None) -> torch.Tensor:
        """The LLM's next-token logits (B, L, V) on input embeddings (``positions``: what ``positions`` gave,
        moved by ``insert_prompts``)."""
        extra = {} if positions is None else {"position_ids": positions}
        logits = self.causal_lm(inputs_embeds=embeds, attention_mask=attention_mask, use_cache=False, **extra).logits
        if self.output_vocab is not None:  # rows the original model does not have: no probability at all
            logits[..., self.output_vocab:] = torch.finfo(logits.dtype).min / 2
        return logits

    def answer_token_loss(self, embeds: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                          positions: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) sums of the cross-entropy over each sample's answer tokens and (B,) their counts
        (``answer_token_ce`` of the logits)."""
        return answer_token_ce(self.logits(embeds, attention_mask, positions), labels)

    def lm_loss(self, embeds: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                positions: Any = None) -> torch.Tensor:
        """Per-sample mean cross-entropy over the answer tokens (B,)."""
        sums, counts = self.answer_token_loss(embeds, attention_mask, labels, positions)
        return sums / counts.clamp_min(1)

    def decoding(self) -> "Decoding":
        """How this checkpoint asks to be decoded: its ``generation_config`` (``generation_config.json``), as
        transformers' ``generate`` honours it, with the official evaluation scripts' overrides on top (CoIN's,
        MCITlib's and MLLM-CL's pass temperature 0 and num_beams 1: greedy; their max_new_tokens is the task's
        ``eval.max_new_tokens``). The config is the one the family's own ``generate`` reads: the model's, or for
        InstructBLIP its language model's (transformers' InstructBLIP generates through the language model)."""
        gc = getattr(self.causal_lm, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None)
        eos = self.tokenizer.eos_token_id if eos is None else eos
        eos = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        penalty = getattr(gc, "repetition_penalty", None)
        return Decoding(eos=eos, pad=int(self.tokenizer.pad_token_id),
                        repetition_penalty=1.0 if penalty is None else float(penalty), output_vocab=self.output_vocab)

    @torch.no_grad()
    def generate(self, embeds: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 positions: torch.Tensor | None = None, seen_ids: torch.Tensor | None = None) -> list[str]:
        """Batched greedy decoding with the KV cache; the decoded answers without special tokens. ``seen_ids``: the
        prompt's token ids (the batch's ``input_ids``), which a repetition penalty counts as transformers' generate
        does when it is given them (a prompt inserted as embeddings has no ids and is not counted)."""
        if positions is not None:
            return self._greedy_with_positions(embeds, attention_mask, positions, max_new_tokens, seen_ids)
        d = self.decoding()
        from transformers import LogitsProcessorList

        out = self.causal_lm.generate(inputs_embeds=embeds, attention_mask=attention_mask,
                                      max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, use_cache=True,
                                      pad_token_id=d.pad, eos_token_id=d.eos, repetition_penalty=1.0,
                                      logits_processor=LogitsProcessorList(d.processors(seen_ids)))
        return [t.strip() for t in self.tokenizer.batch_decode(out, skip_special_tokens=True)]

    def greedy_loop(self, first: Any, logits_of: Callable[[Any], torch.Tensor],
                    advance: Callable[[torch.Tensor, int, Any], Any], max_new_tokens: int,
                    seen_ids: torch.Tensor | None) -> list[str]:
        """The greedy decoding a family runs itself (explicit positions, deepstack): from the prompt's output
        ``first``, ``logits_of(out)`` gives the next-token logits (B, V) and ``advance(token, step, out)`` feeds the
        chosen tokens; the checkpoint's ``decoding()`` (repetition penalty, every EOS id) as transformers applies
        it; finished rows get padding."""
        d = self.decoding()
        processors = d.processors(seen_ids)
        out, tokens = first, []
        scores = logits_of(out).float()
        eos = torch.tensor(d.eos, device=scores.device)
        done = torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
        for step in range(max_new_tokens):
            if step:
                scores = logits_of(out).float()
            so_far = torch.stack(tokens, 1) if tokens else scores.new_zeros(scores.shape[0], 0, dtype=torch.long)
            for proc in processors:
                scores = proc(so_far, scores)
            tok = scores.argmax(-1)
            tok = torch.where(done, torch.full_like(tok, d.pad), tok)
            tokens.append(tok)
            done |= torch.isin(tok, eos)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            out = advance(tok, step, out)
        rows = torch.stack(tokens, 1).tolist()  # up to and with the first EOS, decoded as transformers' output is
        cut = [next((i + 1 for i, x in enumerate(row) if x in d.eos), len(row)) for row in rows]
        return [t.strip() for t in self.tokenizer.batch_decode([row[:c] for row, c in zip(rows, cut)],
                                                                skip_special_tokens=True)]

    def _greedy_with_positions(self, embeds: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                               max_new_tokens: int, seen_ids: torch.Tensor | None = None) -> list[str]:
        """Greedy decoding with the KV cache and explicit M-RoPE positions (Qwen2-VL with prompts:
        ``generate`` would recompute positions from input ids the embeddings no longer match). Each
        new token takes the next position after the row's largest one, in all three sections."""
        B = embeds.shape[0]
        # logits_to_keep=1: only the last position's logits (as transformers' generate asks): the whole prompt's
        # would cost a (B, T, vocab) tensor and the output layer over every prompt token (1.6x the pass on Qwen2-VL)
        first = self.model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                           logits_to_keep=1)
        nxt = positions.amax(dim=(0, 2)) + 1  # (B,)
        mask = [attention_mask]

        def advance(tok: torch.Tensor, step: int, out: Any) -> Any:
            mask[0] = torch.cat([mask[0], mask[0].new_ones(B, 1)], 1)
            pos = (nxt + step).view(1, B, 1).expand(3, B, 1)
            return self.model(inputs_embeds=self.model.get_input_embeddings()(tok)[:, None], attention_mask=mask[0],
                              position_ids=pos, past_key_values=out.past_key_values, use_cache=True)

        return self.greedy_loop(first, lambda out: out.logits[:, -1], advance, max_new_tokens, seen_ids)


@dataclass
class Decoding:
    """A checkpoint's decoding settings (``MLLMBackbone.decoding``): its EOS ids, padding and repetition penalty."""

    eos: list[int]
    pad: int
    repetition_penalty: float = 1.0
    output_vocab: int | None = None  # ids from here on are never generated (``MLLMBackbone._output_vocab``)

    def processors(self, seen_ids: torch.Tensor | None) -> list[Any]:
        """transformers' logits processors for these settings, the prompt's ``seen_ids`` counted before the tokens
        generated so far (transformers' generate gets them as its input ids; here the prompt is embeddings)."""
        out: list[Any] = [] if self.repetition_penalty == 1.0 else [
            _PromptCounted(self.repetition_penalty, seen_ids, self.pad)]
        if self.output_vocab is not None:
            out.append(_SuppressFrom(self.output_vocab))
        return out


class _SuppressFrom:
    """Scores of the ids from ``first`` on set to -inf: ids the original model cannot output."""

    def __init__(self, first: int) -> None:
        self.first = first

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[..., self.first:] = float("-inf")
        return scores


class _PromptCounted:
    """transformers' ``RepetitionPenaltyLogitsProcessor`` over the prompt's ids followed by the generated ones. The
    prompt's left padding is not counted, as transformers' ``generate`` leaves it out (``prompt_ignore_length`` =
    the padding length of each row): a padding id in the prompt does not make the model less likely to say it."""

    def __init__(self, penalty: float, seen_ids: torch.Tensor | None, pad: int) -> None:
        from transformers import RepetitionPenaltyLogitsProcessor

        lead = None if seen_ids is None else (seen_ids != pad).int().argmax(dim=1)
        self.inner = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=lead)
        self.seen = seen_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = input_ids if self.seen is None else torch.cat([self.seen.to(input_ids.device), input_ids], 1)
        return self.inner(ids, scores)


# llava-hf/llava-1.5-7b-hf's architecture (CLIP ViT-L/14-336 + Vicuna-7B), for building it without weights.
LLAVA15_7B = {
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
                      "num_hidden_layers": 24, "image_size": 336, "patch_size": 14, "projection_dim": 768},
    "text_config": {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
                    "num_key_value_heads": 32, "num_hidden_layers": 32, "vocab_size": 32064,
                    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    "image_token_index": 32000, "image_seq_length": 576, "projector_hidden_act": "gelu",
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "pad_token_id": 32001,
}


def llava_config(source: str | dict = "llava-1.5-7b") -> Any:
    """A LlavaConfig from a checkpoint directory / config.json, a dict, or the built-in ``llava-1.5-7b``."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    if isinstance(source, str) and source != "llava-1.5-7b":
        p = Path(source)
        return LlavaConfig.from_pretrained(str(p.parent if p.name == "config.json" else p))
    d = dict(LLAVA15_7B if source == "llava-1.5-7b" else source)
    return LlavaConfig(vision_config=CLIPVisionConfig(**d.pop("vision_config")),
                       text_config=LlamaConfig(**d.pop("text_config")), **d)


def build_empty(source: str | dict = "llava-1.5-7b") -> MLLMBackbone:
    """The full architecture on the meta device (accelerate's init_empty_weights): no weight memory."""
    from accelerate import init_empty_weights
    from transformers import LlavaForConditionalGeneration

    with init_empty_weights():
        model = LlavaForConditionalGeneration(llava_config(source))
    return MLLMBackbone.wrap(model, None)
