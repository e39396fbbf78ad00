"""InstructBLIP with a decoder-only LLM (``InstructBlipForConditionalGeneration``).

The Q-Former reads the instruction (its own tokenizer) and its query outputs fill the image tokens, which the
processor puts before BOS; the causal LM is called directly on input embeddings (the wrapper's forward would
recompute the image features).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mcit.core.registry import BACKBONES
from mcit.data.types import Batch
from mcit.models.base import BackboneError
from mcit.models.mllm import MLLMBackbone


@BACKBONES.register("instructblip")
class InstructBlipBackbone(MLLMBackbone):
    """InstructBLIP with a decoder-only LLM (InstructBlipForConditionalGeneration)."""

    kind = "instructblip"
    model_class = "InstructBlipForConditionalGeneration"
    model_types = ("instructblip",)
    unquantized = ("lm_head", ".*vision_model", ".*qformer", ".*language_projection")
    projector_path = "language_projection"  # the Q-Former's outputs into the LLM

    @classmethod
    def tiny(cls, texts: list[str], seed: int = 0) -> tuple[nn.Module, Any]:
        from mcit.models.tiny_llava import build_instructblip, train_tokenizer

        return build_instructblip(train_tokenizer(texts, image_token_attribute=False), seed=seed)

    def validate(self, model: nn.Module) -> None:
        if not model.config.use_decoder_only_language_model:
            raise BackboneError("InstructBLIP with an encoder-decoder LLM (Flan-T5) is not supported: methods "
                                "prepend prompts to a decoder-only LLM's input embeddings")

    @property
    def language_model(self) -> nn.Module:
        return self.model.language_model

    @property
    def causal_lm(self) -> nn.Module:
        return self.model.language_model

    def processor_text(self, turns: list[tuple[str, str]]) -> str:
        """The instruction itself: the processor puts the query tokens before BOS and gives the Q-Former
        its own copy of the text."""
        from mcit.models import chat

        return turns[-1][0].replace(chat.IMAGE, "").strip()

    def image_outputs(self, enc: dict) -> list[dict[str, Any]]:
        out = super().image_outputs(enc)
        for row, extra in enumerate(out):  # the Q-Former's instruction, unpadded
            keep = enc["qformer_attention_mask"][row].bool()
            extra["qformer_input_ids"] = enc["qformer_input_ids"][row][keep][None]
        return out

    def image_tokens(self, ids: list[int], flags: list[bool], turns: list[tuple[str, str]], has_image: bool,
                     extra: dict) -> tuple[list[int], list[bool], dict]:
        """The image's query tokens go first; a text-only sample still gives the Q-Former its instruction."""
        if has_image:
            return [self.image_token_id] + ids, [False] + flags, extra
        enc = self.processor.qformer_tokenizer([turns[-1][0]], return_tensors="pt")
        return ids, flags, {"qformer_input_ids": enc["input_ids"]}

    def extra_inputs(self, encs: list[dict], inputs: dict[str, torch.Tensor]) -> None:
        """The Q-Former's own copy of each instruction, right-padded."""
        rows = [e["qformer_input_ids"][0].tolist() for e in encs]
        n = max(len(x) for x in rows)
        qf = torch.zeros(len(rows), n, dtype=torch.long)
        qm = torch.zeros(len(rows), n, dtype=torch.long)
        for i, x in enumerate(rows):
            qf[i, : len(x)] = torch.tensor(x)
            qm[i, : len(x)] = 1
        inputs.update(qformer_input_ids=qf, qformer_attention_mask=qm)

    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        """The base's, with the Q-Former's copy of each image row's instruction."""
        out = super().model_inputs(batch)
        if "pixel_values" in out:
            has = self.image_rows(batch)
            out["qformer_input_ids"] = batch.inputs["qformer_input_ids"][has]
            out["qformer_attention_mask"] = batch.inputs["qformer_attention_mask"][has]
        return out

    def vision(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The Q-Former's query outputs (projected) of the rows with an image, and the vision tower's pooled
        feature of every row (text-only rows: their zero image, as LLaVA's training does)."""
        out = self.model.get_image_features(batch.pixel_values.to(self.dtype), batch.inputs["qformer_input_ids"],
                                            batch.inputs["qformer_attention_mask"], return_dict=True)
        return out.pooler_output[self.image_rows(batch)], out.vision_outputs.pooler_output
