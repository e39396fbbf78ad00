"""Shared machinery of methods that tune a frozen multimodal LLM (``backbone.kind: llava``).

A subclass decides which prompt vectors (B, P, d) go in front of each sample's input embeddings
(``select_prompts``) and may add per-sample terms; this base builds the embeddings, inserts the
prompts, computes the answer-token loss and generates. ``predict`` (classification) does not apply.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from mcit.data.types import Batch
from mcit.methods.base import LossTerms, Method


class InstructionMethod(Method):
    """Base of MCIT methods: training by answer-token loss, evaluation by generation."""

    token_loss = True

    def _check_backbone(self) -> None:
        if getattr(self.backbone, "task_type", None) != "generation":
            from mcit.models.mllm import MLLMBackbone

            kinds = ", ".join(f.kind for f in MLLMBackbone.families())
            raise TypeError(f"method {self.name} tunes a multimodal LLM; backbone.kind must be one of its families "
                            f"({kinds})")

    def select_prompts(self, batch: Batch, embeds: torch.Tensor, image_query: torch.Tensor
                       ) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """Prompt vectors (B, P, d) for each sample (or None) and extra outputs for ``loss``."""
        return None, {}

    _bypass = False

    @contextmanager
    def zero_shot(self) -> Iterator[None]:
        """Zero-shot = the frozen pre-trained MLLM with nothing of the method in its input, so every
        method's forward transfer is measured against the same row (LoRA's untrained adapters are
        zero, so the same holds for it without bypassing anything)."""
        self._bypass = True
        try:
            yield
        finally:
            self._bypass = False

    def _inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, dict[str, Any]]:
        embeds, image_query = self.backbone.input_embeddings(batch)
        prompts, extra = (None, {}) if self._bypass else self.select_prompts(batch, embeds, image_query)
        e, m, lab, pos = self.backbone.insert_prompts(embeds, batch.inputs["attention_mask"], prompts, batch.labels,
                                                      self.backbone.positions(batch))
        return e, m, lab, pos, extra

    def train_outputs(self, batch: Batch) -> dict[str, Any]:
        e, m, lab, pos, extra = self._inputs(batch)
        return {**lm_outputs(self.backbone.answer_token_loss(e, m, lab, pos)), **extra}

    def loss(self, batch: Batch, outputs: dict[str, Any]) -> LossTerms:
        return LossTerms(tokens=outputs["lm_tokens"], logs={"lm_loss": float(outputs["lm_loss"].detach().mean())})

    def answer_tokens(self, batch: Batch) -> int:
        """The answer tokens of ``batch``'s real samples (what ``lm_tokens`` counts): the engine's token-mean
        normaliser, summed over the accumulation window and the ranks before the window's first backward."""
        target = batch.labels[:, 1:]
        return int(((target != -100).sum(1) * (batch.valid > 0)).sum())

    @torch.no_grad()
    def generate(self, batch: Batch, max_new_tokens: int) -> list[str]:
        """Greedy answers, one independent decision per sample."""
        e, m, _, pos, _ = self._inputs(batch)
        return self.backbone.generate(e, m, max_new_tokens, pos, seen_ids=batch.inputs.get("input_ids"))

    def predict(self, batch: Batch) -> torch.Tensor:
        raise TypeError(f"method {self.name} generates answers; it has no class prediction")


def lm_outputs(tokens: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """``train_outputs``' LM entries: ``lm_tokens`` (per-sample sums and counts, for ``LossTerms(tokens=...)``)
    and ``lm_loss``, each sample's mean (logs, tests, the interference curve)."""
    sums, counts = tokens
    return {"lm_tokens": (sums, counts), "lm_loss": sums / counts.clamp_min(1)}


def init_from_vocab(backbone: Any, shape: tuple[int, ...]) -> torch.nn.Parameter:
    """Prompt vectors initialised from randomly drawn rows of the frozen token embedding matrix (the
    usual prompt-tuning initialisation: prompts start on the scale of real tokens)."""
    table = backbone.token_embeddings().detach()
    if table.is_meta:  # an architecture built without weights (mcit.models.inspect): shapes only
        return torch.nn.Parameter(torch.empty(shape, device="meta"))
    table = table.float().cpu()
    n = 1
    for s in shape[:-1]:
        n *= s
    idx = torch.randint(0, table.shape[0], (n,))
    return torch.nn.Parameter(table[idx].reshape(shape).clone())
