"""STAR-Prompt (Menabue et al., arXiv 2403.06870, "Semantic Residual Prompts for Continual Learning"),
as in the paper and its official code (aimagelab/mammoth: ``starprompt`` and ``star_prompt_utils``).

Two levels, run as two phases of every task (two train stages and two subspace stages of the
pipeline, in this order):

``first`` -- CLIP's text side (the CLIP checkpoint at ``clip_path``, an auxiliary backbone resolved
through the zoo like the run's backbone and loaded once per process; frozen). Every class has one
learnable context token that replaces "X" in "X <class name>."; the text encoder turns it into the
class's key (a prototype in CLIP's image-text space). Training task t fits its classes' tokens with
CLIP's image-text cross-entropy over its own classes (earlier tasks' keys frozen) plus
``lambda_ortho_first`` x the squared similarity of its tokens to earlier tokens. The subspace stage
fits a mixture of Gaussians to each new class's CLIP image embeddings and then replays samples of
every seen class's mixture to re-align the new tokens (SGD, ``gr_first_lr``, ``gr_first_epochs``),
and stores the new keys.

``second`` -- the ViT (the pipeline's backbone; frozen). Every class c has, in every prompted block
l, a residual prompt p_l[c] (D) and a modulation vector a_l[c] (E). For an image with CLIP embedding
q, block l scores each seen class by 5 * cos(q * softmax(a_l[c]), key[c]), keeps only the best class
(its score kept as a confidence, ``confidence_modulation``) and adds score * p_l[best] to the value of
every head, which equals adding W_o p after the attention (each attention row sums to 1). Training
task t fits its classes' prompts and the linear head (cross-entropy over its classes; earlier classes'
prompts frozen) plus ``lambda_ortho_second`` x the orthogonality loss of the official code. The
subspace stage fits a mixture of Gaussians to each new class's prompted [CLS] feature, keeps the head
as trained (the next task starts from it), and from the second task on re-trains a copy of the head
on samples of every seen class's mixture (logits divided by 0.1 x their norm; SGD,
``gr_second_lr``, ``gr_second_epochs`` + 5 per task) -- the head the evaluation uses.

``gr_model: gaussian`` (the paper's ablation) replaces the second level's mixtures by one Gaussian per
class; the first level keeps its ``mog_components`` mixture, as in the official code.

Images, as mammoth (d003b9a) feeds them. The first level trains and fits its mixtures on CLIP's own
preprocess (``end_to_end_model.py`` 244-249 swaps the train and test loaders' transform to the
``clip_preprocess`` of ``clip.load``, ``first_stage_model.py`` 54: Resize(224, bicubic, shorter side),
CenterCrop(224), CLIP's mean / std, no augmentation; ``update_statistics`` streams that train loader): the
phase's ``image_pipeline`` is the CLIP backbone's own. The second level trains on the run's augmented
crops and fits its mixtures on the same augmented train stream (``update_statistics`` in
``end_to_end_model.py`` iterates ``dataset.train_loader``, one pass: ``num_monte_carlo_gr_second_stage`` 1);
its CLIP query is the ViT's pixels re-normalised for CLIP (``second_stage_model.get_query``: denormalise, then
CLIP's Normalize), at evaluation too. ``first_pipeline: backbone`` and ``second_statistics: eval`` are the
earlier choices (the ViT's crops re-normalised for the first level, the eval preset for both levels'
statistics).

Departures from the official code: the mixtures are fitted by scikit-learn's EM (the official gmm-torch
port has a wrong diagonal log-likelihood, see ``fit_mixture``); inference is per sample (the official
code is too); the first level's CLIP runs in float32 (mammoth converts it to float16 while the first level
trains, "for speedup").
"""

from __future__ import annotations

from typing import Literal, Mapping

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import AuxiliaryBackbone, ImagePipeline, LayerList, LossTerms, Method, MethodParams, auxiliary_of
from mcit.methods.class_gaussians import fit_mixture, sample_mixture
from mcit.methods.prompting import HEAD_INIT_DOC, HeadInit, classifier_head


class STARPromptParams(MethodParams):
    clip_path: str = Field(..., description="the first level's CLIP (official: OpenAI ViT-L/14): an HF directory, "
                                            "or the original file for a zoo clip_tag",
                           json_schema_extra={"input_path": True})
    clip_tag: str = Field("local", description="backbone zoo tag of clip_path (e.g. clip_vitl14_openai), or a label "
                                              "for an HF directory; recorded with its sha256 in backbone.json")
    clip_tokenizer: str | None = Field(None, description="clip_path an OpenAI file: a directory with its tokenizer",
                                       json_schema_extra={"input_path": True})
    prompt_layers: LayerList | None = Field(None, description="ViT blocks with residual prompts; default all")
    confidence_modulation: bool = Field(True, description="scale the best class's residual prompt by its score; "
                                                          "false: by 1")
    map_mask_gradient: Literal["all_current", "selected"] = Field(
        "all_current", description="which classes' a_c the masked score map trains: every current class (the "
                                   "official code: the mask is invisible to autograd) or only the selected one")
    first_pipeline: Literal["clip", "backbone"] = Field(
        "clip", description="the first level's images: CLIP's own preprocess, train and statistics (the official "
                            "code), or the ViT's augmented crops re-normalised for CLIP (statistics: eval preset)")
    second_statistics: Literal["augmented", "eval"] = Field(
        "augmented", description="the second level's mixtures fitted on the augmented train stream (the official "
                                 "code) or on the eval preset's images")
    # first level
    first_epochs: int | None = Field(None, ge=1, description="default: train.epochs")
    first_lr: float = Field(0.002, gt=0, description="the first level's learning rate (context tokens)")
    first_optimizer: Literal["sgd", "adam"] = Field("sgd", description="the first level's optimizer")
    first_momentum: float = Field(0.0, ge=0, description="the first level's optimizer momentum")
    lambda_ortho_first: float = Field(30.0, ge=0, description="weight of the squared similarity of the task's "
                                                              "context tokens to earlier classes' tokens")
    gr_first_epochs: int = Field(10, ge=0, description="epochs of the first level's replay re-alignment of the "
                                                       "context tokens")
    gr_first_lr: float = Field(0.05, gt=0, description="SGD lr of the first level's replay re-alignment")
    # second level
    lambda_ortho_second: float = Field(10.0, ge=0, description="weight of the official orthogonality loss of the "
                                                               "residual prompts")
    gr_second_epochs: int = Field(10, ge=0, description="plus 5 per task, as the official code")
    gr_second_lr: float = Field(0.001, gt=0, description="SGD lr of the second level's replay re-training of the "
                                                         "head")
    # generative replay
    enable_gr: bool = Field(True, description="generative replay: fit the class mixtures and re-align on their "
                                              "samples (false: neither level replays)")
    gr_model: Literal["mog", "gaussian"] = Field(
        "mog", description="the second level's class model: a mixture of mog_components Gaussians or one Gaussian "
                           "(the paper's ablation)")
    mog_components: int = Field(5, ge=1, description="Gaussians per class mixture (diagonal covariance)")
    mog_iters_first: int = Field(200, ge=1, description="EM iterations of the first level's mixtures")
    mog_iters_second: int = Field(500, ge=1, description="EM iterations of the second level's mixtures")
    gr_samples: int = Field(256, ge=1, description="samples per class and replay epoch")
    gr_batch_size: int = Field(128, ge=1, description="batch size of the replay alignment (both levels)")
    head_init: HeadInit = Field("timm", description=HEAD_INIT_DOC)


def _orthogonal(shape: tuple[int, ...]) -> nn.Parameter:
    p = torch.zeros(shape)
    nn.init.orthogonal_(p)
    return nn.Parameter(p)


@METHODS.register("star_prompt")
class STARPrompt(Method):
    name = "star_prompt"
    Params = STARPromptParams
    phases = ("first", "second")
    has_subspace_stage = True

    @classmethod
    def auxiliary_backbones(cls, params: STARPromptParams) -> dict[str, AuxiliaryBackbone]:
        return {"clip": AuxiliaryBackbone("clip", params.clip_path, params.clip_tag, params.clip_tokenizer,
                                          key="method.clip_path")}

    def __init__(self, params: STARPromptParams, backbone: nn.Module, sequence: TaskSequence, *,
                 auxiliary: Mapping[str, nn.Module] | None = None) -> None:
        super().__init__(params, backbone, sequence)
        clip = auxiliary_of(auxiliary, "clip", self.name)
        object.__setattr__(self, "clip", clip)  # frozen, by reference: not in the state dict
        C, D, E = sequence.num_classes, backbone.hidden_size, clip.projection_dim
        self.layers = list(range(backbone.num_layers)) if params.prompt_layers is None else list(params.prompt_layers)
        # first level: "X <name>." with X's embedding learned per class
        names = list(sequence.class_names) or [str(c) for c in sequence.labels]
        enc = clip.tokenize([f"X {n}." for n in names])
        with torch.no_grad():
            emb = clip.model.text_model.embeddings.token_embedding(enc["input_ids"]).float()
        self.register_buffer("token_ids", enc["input_ids"], persistent=False)
        self.register_buffer("token_mask", enc["attention_mask"], persistent=False)
        self.register_buffer("token_embeds", emb, persistent=False)
        self.ctx = nn.Parameter(torch.randn(C, 1, emb.shape[-1]) * 0.02)
        self.register_buffer("keys", torch.zeros(C, E))
        self.register_buffer("seen", torch.zeros(C, dtype=torch.bool))
        # second level: one residual prompt and one modulation vector per class and block
        for layer in self.layers:
            # the official init: orthogonal over (C, 3 x D), keeping the first D of each row
            setattr(self, f"p_{layer}", nn.Parameter(_orthogonal((C, 3, D)).data[:, 0].clone()))
            setattr(self, f"a_{layer}", _orthogonal((C, E)))
        self.head = classifier_head(D, C, self.params.head_init)
        self.register_buffer("head_backup_w", torch.zeros(C, D))
        self.register_buffer("head_backup_b", torch.zeros(C))
        # the official first level always replays a mixture; gr_model chooses the second level's
        second_k = params.mog_components if params.gr_model == "mog" else 1
        for level, dim, K in (("1", E, params.mog_components), ("2", D, second_k)):
            self.register_buffer(f"mog{level}_w", torch.zeros(C, K))
            self.register_buffer(f"mog{level}_mu", torch.zeros(C, K, dim))
            self.register_buffer(f"mog{level}_var", torch.ones(C, K, dim))
        self.gr_log: dict[str, float] = {}
        self.set_phase(self.phase)

    # -- phases ------------------------------------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        super().set_phase(phase)
        first = phase == "first"
        self.ctx.requires_grad_(first)
        for layer in self.layers:
            getattr(self, f"p_{layer}").requires_grad_(not first)
            getattr(self, f"a_{layer}").requires_grad_(not first)
        self.head.requires_grad_(not first)

    def phase_train(self, phase: str) -> dict:
        if phase != "first":
            return {}
        p = self.params
        out = {"lr": p.first_lr, "optimizer": p.first_optimizer, "momentum": p.first_momentum,
               "weight_decay": 0.0, "lr_schedule": "constant"}
        if p.first_epochs:
            out["epochs"] = p.first_epochs
        return out

    @classmethod
    def image_pipeline(cls, params: STARPromptParams, phase: str, stage: str) -> ImagePipeline:
        if phase == "first":
            return ImagePipeline(auxiliary="clip") if params.first_pipeline == "clip" else ImagePipeline()
        if stage == "subspace":
            return ImagePipeline(augment=params.second_statistics == "augmented")
        return ImagePipeline()

    def before_task(self, task: int) -> None:
        super().before_task(task)
        if self.phase == "second" and task > 0 and self.params.enable_gr:
            with torch.no_grad():  # the official recall: train from the head before its replay alignment
                self.head.weight.copy_(self.head_backup_w)
                self.head.bias.copy_(self.head_backup_b)

    def _classes(self, task: int) -> list[int]:
        return list(self.sequence.tasks[task].classes)

    def _past(self, task: int) -> list[int]:
        return [c for t in range(task) for c in self._classes(t)]

    # -- first level -------------------------------------------------------------------------------
    def clip_query(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """CLIP's (unnormalised) image embedding: of CLIP's own pixels in the first level with
        ``first_pipeline: clip``, else of the ViT's input images re-normalised for CLIP."""
        self.clip.to(pixel_values.device)
        if not (self.phase == "first" and self.params.first_pipeline == "clip"):
            pixel_values = self.clip.from_pixels_of(pixel_values, self.backbone.mean, self.backbone.std)
        return self.clip.image_features(pixel_values, normalize=False)

    def compute_keys(self, classes: list[int]) -> torch.Tensor:
        """Normalised text embeddings of "<ctx_c> <name_c>." for ``classes``."""
        idx = torch.tensor(classes, device=self.ctx.device)
        emb = self.token_embeds[idx]
        emb = torch.cat([emb[:, :1], self.ctx[idx].to(emb.dtype), emb[:, 2:]], dim=1)
        return self.clip.text_features_from_embeddings(emb, self.token_ids[idx], self.token_mask[idx])

    def ortho_first(self, task: int) -> torch.Tensor:
        past = self._past(task)
        if not past:
            return self.ctx.sum() * 0
        cur, old = self.ctx[self._classes(task)], self.ctx[past].detach()
        return (torch.matmul(cur.permute(1, 0, 2), old.permute(1, 2, 0)) ** 2).mean()

    # -- second level ------------------------------------------------------------------------------
    def _maps(self, layer: int, query: torch.Tensor, classes: list[int], frozen: int) -> torch.Tensor:
        """Per-class scores 5 cos(q * softmax(a_c), key_c) of ``classes``, masked to the best class."""
        a = getattr(self, f"a_{layer}")[classes]
        keys = self.keys[classes]
        filt = torch.softmax(a, dim=-1)
        scaled = F.normalize(query.unsqueeze(1) * filt.unsqueeze(0), dim=-1)
        maps = torch.einsum("bcd,cd->bc", scaled, keys) * 5
        if frozen:
            maps = torch.cat([maps[:, :frozen].detach(), maps[:, frozen:]], dim=1)
        best = maps.argmax(dim=1, keepdim=True)
        keep = torch.zeros_like(maps, dtype=torch.bool).scatter_(1, best, True)
        if self.params.map_mask_gradient == "all_current":
            # the official in-place zeroing under no_grad: autograd never sees the mask, so the
            # gradient of the masked map reaches every (current) class's a_c, not only the best one's
            maps = maps - (maps * ~keep).detach()
        else:
            maps = maps.masked_fill(~keep, 0.0)
        if not self.params.confidence_modulation:
            maps = (maps != 0).to(maps.dtype)
        return maps

    def super_prompts(self, query: torch.Tensor, classes: list[int], frozen: int = 0) -> dict:
        """Every prompted block's LayerPrompt: the residual (B, H, 1, hd) of each sample's best class."""
        from mcit.models.base import LayerPrompt

        b, h, hd = query.shape[0], self.backbone.num_heads, self.backbone.head_dim
        out = {}
        for layer in self.layers:
            maps = self._maps(layer, query, classes, frozen)
            p = getattr(self, f"p_{layer}")[classes]
            if frozen:
                p = torch.cat([p[:frozen].detach(), p[frozen:]], dim=0)
            sp = maps @ p.to(maps.dtype)
            out[layer] = LayerPrompt(value_residual=sp.view(b, h, 1, hd))
        return out

    def vit_features(self, pixel_values: torch.Tensor, classes: list[int], frozen: int = 0) -> torch.Tensor:
        """The prompted ViT's [CLS] feature (final LayerNorm) with the prompts of ``classes``."""
        if not classes:
            return self.backbone.cls_features(pixel_values)
        prompts = self.super_prompts(self.clip_query(pixel_values), classes, frozen)
        return self.backbone.encode(self.backbone.embed(pixel_values), prompts)[:, 0]

    def ortho_second(self, task: int) -> torch.Tensor:
        past, cur_c = self._past(task), self._classes(task)
        if not past:
            return self.head.weight.sum() * 0
        losses = []
        for layer in self.layers:
            p = getattr(self, f"p_{layer}")
            cur, old = p[cur_c], p[past].detach()
            intra = (torch.diagonal(cur @ cur.t()) - 1).pow(2).mean()
            losses.append(intra + (cur @ old.t()).pow(2).mean())
        return sum(losses) / len(losses)

    # -- training ----------------------------------------------------------------------------------
    def train_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        t, x = batch.task, batch.pixel_values
        cur = self._classes(t)
        if self.phase == "first":
            q = F.normalize(self.clip_query(x), dim=-1)
            logits = self.clip.logit_scale.exp().float() * q @ self.compute_keys(cur).t()
            return {"logits": logits, "reg": self.params.lambda_ortho_first * self.ortho_first(t)}
        past = self._past(t)
        feats = self.vit_features(x, past + cur, frozen=len(past))
        return {"logits": self.head(feats.to(self.head.weight.dtype))[:, cur],
                "reg": self.params.lambda_ortho_second * self.ortho_second(t)}

    def loss(self, batch: Batch, outputs: dict[str, torch.Tensor]) -> LossTerms:
        # logits over the task's own classes (earlier classes are masked in the official code)
        local = {c: i for i, c in enumerate(self._classes(batch.task))}
        target = torch.tensor([local.get(int(y), 0) for y in batch.labels.tolist()], device=batch.labels.device)
        ce = F.cross_entropy(outputs["logits"].float(), target, reduction="none")
        return LossTerms(per_sample=ce, regularizer=outputs["reg"])

    # -- subspace stages: mixtures and generative replay -------------------------------------------
    def statistics(self, batch: Batch) -> dict[str, torch.Tensor]:
        valid = batch.valid.bool()
        x, y = batch.pixel_values[valid], batch.labels[valid]
        if self.phase == "first":
            feats = self.clip_query(x)
        else:
            t = self.current_task
            feats = self.vit_features(x, self._past(t) + self._classes(t))
        return {"cat:features": feats.float().cpu(), "cat:labels": y.cpu()}

    def _fit(self, level: str, feats: torch.Tensor, labels: torch.Tensor, task: int) -> None:
        iters = self.params.mog_iters_first if level == "1" else self.params.mog_iters_second
        K = getattr(self, f"mog{level}_w").shape[1]
        for c in self._classes(task):
            rows = feats[labels == c]
            if len(rows) == 0:
                continue
            w, mu, var = fit_mixture(rows, K, iters, seed=1000 * task + c)
            getattr(self, f"mog{level}_w")[c] = w.to(self.keys.device)
            getattr(self, f"mog{level}_mu")[c] = mu.to(self.keys.device)
            getattr(self, f"mog{level}_var")[c] = var.to(self.keys.device)

    def _replay(self, level: str, classes: list[int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for c in classes:
            xs.append(sample_mixture(getattr(self, f"mog{level}_w")[c], getattr(self, f"mog{level}_mu")[c],
                                     getattr(self, f"mog{level}_var")[c], self.params.gr_samples, g))
            ys.append(torch.full((self.params.gr_samples,), c, dtype=torch.long))
        x, y = torch.cat(xs), torch.cat(ys)
        perm = torch.randperm(len(y), generator=g)
        return x[perm].to(self.keys.device), y[perm].to(self.keys.device)

    def finalize_statistics(self, reduced: dict[str, torch.Tensor], task: int) -> None:
        feats, labels = reduced["cat:features"], reduced["cat:labels"].long()
        cur, seen = self._classes(task), self._past(task) + self._classes(task)
        g = torch.Generator().manual_seed(7919 * (task + 1) + (0 if self.phase == "first" else 1))
        if self.phase == "first":
            if self.params.enable_gr:
                self._fit("1", feats, labels, task)
                self.gr_log["gr_first_loss"] = self._align_first(task, seen, g)
            with torch.no_grad():
                self.keys[cur] = self.compute_keys(cur).to(self.keys.dtype)
            self.seen[cur] = True
            return
        if not self.params.enable_gr:
            return
        self._fit("2", feats, labels, task)
        self.head_backup_w.copy_(self.head.weight.detach())
        self.head_backup_b.copy_(self.head.bias.detach())
        if task > 0:
            self.gr_log["gr_second_loss"] = self._align_second(task, seen, g)

    def _align_first(self, task: int, seen: list[int], g: torch.Generator) -> float:
        cur, past = self._classes(task), self._past(task)
        opt = torch.optim.SGD([self.ctx], lr=self.params.gr_first_lr, momentum=0.0)
        index = {c: i for i, c in enumerate(seen)}
        loss = torch.zeros(())
        self.ctx.requires_grad_(True)
        for _ in range(self.params.gr_first_epochs):
            x, y = self._replay("1", seen, g)
            target = torch.tensor([index[int(c)] for c in y.tolist()], device=y.device)
            for i in range(0, len(y), self.params.gr_batch_size):
                with torch.enable_grad():
                    keys = torch.cat([self.keys[past], self.compute_keys(cur)]) if past else self.compute_keys(cur)
                    q = F.normalize(x[i:i + self.params.gr_batch_size], dim=-1)
                    logits = self.clip.logit_scale.exp().float() * q @ keys.t()
                    loss = F.cross_entropy(logits, target[i:i + self.params.gr_batch_size])
                    opt.zero_grad()
                    loss.backward()
                opt.step()
        return float(loss.detach())

    def _align_second(self, task: int, seen: list[int], g: torch.Generator) -> float:
        head = nn.Linear(self.head.in_features, self.head.out_features).to(self.head.weight.device)
        head.load_state_dict(self.head.state_dict())
        opt = torch.optim.SGD(head.parameters(), lr=self.params.gr_second_lr, momentum=0.0)
        index = {c: i for i, c in enumerate(seen)}
        loss = torch.zeros(())
        for _ in range(self.params.gr_second_epochs + 5 * task):
            x, y = self._replay("2", seen, g)
            target = torch.tensor([index[int(c)] for c in y.tolist()], device=y.device)
            for i in range(0, len(y), self.params.gr_batch_size):
                with torch.enable_grad():
                    logits = head(x[i:i + self.params.gr_batch_size].to(head.weight.dtype))[:, seen].float()
                    logits = logits / (0.1 * (logits.norm(dim=-1, keepdim=True) + 1e-7))
                    loss = F.cross_entropy(logits, target[i:i + self.params.gr_batch_size])
                    opt.zero_grad()
                    loss.backward()
                opt.step()
        self.head.load_state_dict(head.state_dict())
        return float(loss.detach())

    def subspace_report(self) -> dict:
        return dict(self.gr_log)

    # -- inference ---------------------------------------------------------------------------------
    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        seen = torch.nonzero(self.seen).flatten().tolist()
        logits = self.head(self.vit_features(batch.pixel_values, seen).to(self.head.weight.dtype))
        return self.restrict(logits, batch).argmax(dim=-1)
