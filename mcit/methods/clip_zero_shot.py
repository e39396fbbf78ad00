"""Zero-shot CLIP: the baseline row of the CLIP-based methods.

Nothing is trained: each image is classified by the cosine similarity of its CLIP image embedding to
the class names' text embeddings (every template filled in, embedded, normalised and averaged, as
CLIP's prompt ensembling), over the classes the evaluation protocol allows. Run through the same
pipeline, it gives the accuracy matrix a CLIP method must beat; its rows change only because the
set of allowed classes grows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import LossTerms, Method, MethodParams
from mcit.methods.prompting import mask_to_classes


class CLIPZeroShotParams(MethodParams):
    templates: list[str] = Field(default_factory=lambda: ["a photo of a {}."],
                                 description="class-name templates ({} the class name); their text embeddings "
                                             "are averaged (CLIP's prompt ensembling)")


@METHODS.register("clip_zero_shot")
class CLIPZeroShot(Method):
    name = "clip_zero_shot"
    Params = CLIPZeroShotParams

    def __init__(self, params: CLIPZeroShotParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        if not hasattr(backbone, "class_text_features"):
            raise ValueError("method clip_zero_shot needs a CLIP backbone (backbone.kind: clip)")
        names = list(sequence.class_names) or [str(c) for c in sequence.labels]
        self.register_buffer("text_feats", backbone.class_text_features(names, params.templates).float(),
                             persistent=False)

    def train_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """CLIP's logits (exp(logit_scale) * cosine). Nothing trains; the pipeline still measures the loss
        on the first task (a flat training-interference line, the reference for the CLIP methods)."""
        sim = self.backbone.image_features(batch.pixel_values) @ self.text_feats.t()
        return {"logits": self.backbone.logit_scale.exp().float() * sim.float()}

    def loss(self, batch: Batch, outputs: dict[str, torch.Tensor]) -> LossTerms:
        logits = mask_to_classes(outputs["logits"], self.sequence.tasks[batch.task].classes)
        return LossTerms(per_sample=F.cross_entropy(logits, batch.labels, reduction="none"))

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        sim = self.backbone.image_features(batch.pixel_values) @ self.text_feats.t()
        return self.restrict(sim, batch).argmax(dim=-1)
