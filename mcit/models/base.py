"""What every backbone shares, and the image-encoder machinery prompt methods run on.

A backbone is a frozen transformers model behind a small wrapper, registered by kind
(``@BACKBONES.register("vit")``). The registry entry is the wrapper class itself; the pipeline asks it,
never a kind name, what it needs:

* ``task_type``: ``"classification"`` (images -> class indices; CIL) or ``"generation"`` (instruction
  samples -> answers; MCIT): which shards it takes and which evaluation runs;
* ``check(path)``: the cheap pre-flight check of a checkpoint directory (no weights loaded);
* ``from_path(path, dtype, **options)`` with ``options`` the ``backbone:`` config keys named in
  ``load_options``;
* ``make_collate(split, task, train=..., label_index=...)``: how raw samples become a ``Batch``
  (``collate(samples, seed=None)``); a backbone that accepts a ``transform`` argument takes the
  ``data.train_transform`` / ``data.eval_transform`` presets (pre-flight refuses any but ``backbone`` otherwise).

Adding a backbone is one new file in ``mcit/models/`` (docs/architecture.md, "Adding a backbone").

``PromptableImageEncoder`` is the shared base of the ViT and CLIP image sides: we never copy a model,
we call its own submodules (embeddings, blocks, final norm) in order, which lets a method put prompt
tokens between them while the weights stay the checkpoint's. Attention in the blocks goes through
transformers' AttentionInterface (``prompted_attention``), so prefix tuning and gated scores need no
copied attention module.
"""

from __future__ import annotations

import json
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch
from torch import nn

from mcit.core.registry import BACKBONES

if TYPE_CHECKING:
    from mcit.data.transforms import BackbonePreprocessing


class BackboneError(ValueError):
    """A backbone that cannot be loaded; one line naming the path."""


def check_hf_dir(path: str | Path) -> dict:
    """Cheap pre-flight check (no weights loaded): the directory exists and holds an HF config; returns it."""
    p = Path(path)
    if not p.is_dir():
        raise BackboneError(f"backbone path not found: {p}")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise BackboneError(f"backbone path {p} has no config.json (not a transformers checkpoint directory)")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise BackboneError(f"backbone config {cfg} is not valid JSON: {e}") from None


def check_model_type(cls: type, path: str | Path, cfg: dict) -> None:
    """The checkpoint's family (config.json ``model_type``) is one that backbone class loads: a CLIP directory
    given to ``backbone.kind: llava`` is refused naming both, not left to a transformers error mid-load."""
    from mcit.core.registry import BACKBONES

    have = cfg.get("model_type")
    want = getattr(cls, "model_types", ())
    if not want or have in want:
        return
    kind = next((k for k in BACKBONES.names() if BACKBONES.get(k) is cls), cls.__name__)
    fits = [k for k in BACKBONES.names() if have in getattr(BACKBONES.get(k), "model_types", ())]
    raise BackboneError(f"backbone path {path} holds a {have!r} checkpoint (config.json model_type), but backbone.kind "
                        f"{kind} loads {' or '.join(repr(t) for t in want)} checkpoints"
                        + (f"; backbone.kind {fits[0]} loads this one" if fits else ""))


def loading_problems(info: dict[str, Any], ignore_unexpected: tuple[str, ...] = ()) -> str | None:
    """What transformers' ``output_loading_info`` says did not load, in a few words; None when every weight
    loaded. ``ignore_unexpected``: key prefixes a backbone drops on purpose (the ViT pooler)."""
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(k for k in info.get("unexpected_keys") or [] if not k.startswith(ignore_unexpected))
    mismatched = sorted(str(m[0] if isinstance(m, (tuple, list)) else m) for m in info.get("mismatched_keys") or [])
    parts = [f"{len(keys)} {what} (first: {', '.join(keys[:3])})"
             for what, keys in (("missing", missing), ("unexpected", unexpected), ("with other shapes", mismatched))
             if keys]
    return "; ".join(parts) or None


def check_weights(model_cls: Any, path: str | Path, hint: str = "", ignore_unexpected: tuple[str, ...] = (),
                  **kwargs: Any) -> None:
    """Pre-flight's strict check: ``model_cls.from_pretrained(path)`` on the meta device (the checkpoint's key
    names and shapes, no weight read) must find every weight the class has, no other key and no other shape.
    transformers would otherwise initialise what is missing at random and the run would train from it."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the loading report is ours to give, in one line
    try:
        # ignore_mismatched_sizes: report weights of another shape with the rest instead of raising on the first
        _, info = model_cls.from_pretrained(str(path), device_map="meta", output_loading_info=True,
                                            ignore_mismatched_sizes=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - one line naming the path
        raise BackboneError(f"backbone path {path}: {model_cls.__name__} cannot read it: "
                            f"{(str(e).splitlines() or [e.__class__.__name__])[0]}{hint}") from None
    finally:
        hf_logging.set_verbosity(level)
    problems = loading_problems(info, ignore_unexpected)
    if problems:
        raise BackboneError(f"backbone path {path}: its weights do not fit {model_cls.__name__}: {problems}{hint}")


def strict_from_pretrained(model_cls: Any, path: str | Path, ignore_unexpected: tuple[str, ...] = (),
                           **kwargs: Any) -> Any:
    """``model_cls.from_pretrained`` that refuses a checkpoint it could not load whole (a weight missing,
    unexpected or of another shape) instead of training from randomly initialised weights."""
    model, info = model_cls.from_pretrained(str(path), output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
    problems = loading_problems(info, ignore_unexpected)
    if problems:
        raise BackboneError(f"backbone path {path}: its weights do not fit {model_cls.__name__}: {problems}")
    return model


def read_preprocessor(path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``preprocessor_config.json`` (image mean / std, resize filter), or {}."""
    pp = Path(path) / "preprocessor_config.json"
    return json.loads(pp.read_text()) if pp.is_file() else {}


class Backbone(nn.Module, metaclass=ABCMeta):
    """A frozen pre-trained model as the pipeline sees it (see the module docstring); a subclass that
    leaves ``from_path`` or ``make_collate`` out cannot be instantiated."""

    task_type: ClassVar[str] = "classification"
    # ``backbone:`` config keys (besides path) that ``from_path`` takes as keyword arguments
    load_options: ClassVar[tuple[str, ...]] = ()
    # whether ``path`` may also be a model-hub id (with ``backbone.hub: true``): no directory to check or hash
    hub_ids: ClassVar[bool] = False
    # the config.json model_type values this kind loads (empty: not checked)
    model_types: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check(cls, path: str | Path) -> None:
        """Pre-flight check of a checkpoint directory; raise a one-line BackboneError naming the path. A class
        that loads strictly adds ``check_weights`` here; ``from_path`` runs only ``check_files`` (its load is
        the weight check), so the weights are not checked twice on every rank."""
        cls.check_files(path)

    @classmethod
    def check_files(cls, path: str | Path) -> None:
        """The cheap part of ``check`` (files and config, no weights), also run before every load."""
        check_model_type(cls, path, check_hf_dir(path))

    @classmethod
    @abstractmethod
    def from_path(cls, path: str | Path, dtype: torch.dtype = torch.float32, **options: Any) -> "Backbone":
        """The frozen model loaded from ``path`` (a transformers directory) with its processing settings."""

    @abstractmethod
    def make_collate(self, split: Any, task: int, *, train: bool, label_index: dict[int, int],
                     transform: Callable | None = None) -> Callable:
        """How raw samples of ``split`` become a Batch: ``collate(samples, seed=None)``; ``transform``
        (mcit.data.transforms) augments images where the backbone takes them as they are."""

    def train(self, mode: bool = True) -> "Backbone":  # frozen: always eval (no dropout drift)
        return super().train(False)

    def collation_view(self) -> "Backbone":
        """This backbone without its model: the same class and plain attributes (processor, tokenizer, image
        size, normalisation), no submodules, parameters or buffers. A collate bound to it pickles in
        kilobytes, so the loader's persistent workers can be sent each stage's collates (``mcit.data.loader``);
        one bound to the backbone itself would carry the weights."""
        view = object.__new__(type(self))
        state = dict(self.__dict__)
        state.update(_modules={}, _parameters={}, _buffers={}, _non_persistent_buffers_set=set())
        view.__dict__.update(state)
        return view


def backbone_class(kind: str) -> type[Backbone]:
    """The registered backbone ``kind``."""
    return BACKBONES.get(kind)


def load_backbone(kind: str, path: str | Path, dtype: torch.dtype = torch.float32, **options: Any) -> Backbone:
    """The registered backbone ``kind`` from ``path``; ``options`` are its ``load_options``. transformers'
    "Loading weights" bar is turned off: one per rank per model said nothing the pipeline's own lines do not."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return backbone_class(kind).from_path(path, dtype=dtype, **options)


# --------------------------------------------------------------------------------------------------
# Prompted attention

ATTENTION_NAME = "mcit_prompted"


@dataclass
class LayerPrompt:
    """What a method puts into one block's attention (any field may be None).

    ``key`` / ``value``: prefixes (B, H, P, head_dim) placed before the block's own keys and values
    (prefix tuning, as in DualPrompt's and CODA-Prompt's official code: the prefixes live in the
    per-head key/value space, after the projections). ``score_fn(scores, n_prefix)`` rewrites the
    pre-softmax scores (B, H, N, P + N) -- NoRGa's gate on the prefix columns. ``value_residual``
    (B, H, 1, head_dim) is added to every token's value (STAR-Prompt's residual prompt: since each
    attention row sums to 1, this adds W_o p to the block's attention output). ``capture(query,
    probs)`` sees the per-head queries (B, H, N, head_dim) and attention probabilities -- VPT-NSP²'s
    statistics.
    """

    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    value_residual: torch.Tensor | None = None
    score_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    capture: Callable[[torch.Tensor, torch.Tensor], None] | None = None


def prompted_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       mcit_prompt: LayerPrompt | None = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The attention function the frozen encoders run with (registered in transformers' AttentionInterface).

    Without a LayerPrompt it is transformers' own SDPA path, so un-prompted blocks compute exactly
    what the checkpoint computes. With one it is eager attention with the prompt's prefixes, score
    rewrite and capture, which keeps the block (norms, residuals, MLP) transformers' own.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if mcit_prompt is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                               dropout=dropout, **kwargs)
    n_prefix = 0
    if mcit_prompt.value_residual is not None:
        value = value + mcit_prompt.value_residual.to(value.dtype)
    if mcit_prompt.key is not None:
        n_prefix = mcit_prompt.key.shape[2]
        key = torch.cat([mcit_prompt.key.to(key.dtype), key], dim=2)
        value = torch.cat([mcit_prompt.value.to(value.dtype), value], dim=2)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if attention_mask is not None:
        scores = scores + attention_mask
    if mcit_prompt.score_fn is not None:
        scores = mcit_prompt.score_fn(scores, n_prefix)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if mcit_prompt.capture is not None:
        mcit_prompt.capture(query, probs)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return out, probs


# --------------------------------------------------------------------------------------------------
# Image encoders

class PromptableImageEncoder(Backbone):
    """What the ViT and CLIP backbones share: loading, freezing, geometry, prompted attention,
    preprocessing, the per-block encode loop with prompts and the frozen [CLS] query.

    A subclass provides ``load_model(path, dtype) -> (model, extras)`` (``extras``: further
    constructor arguments, e.g. CLIP's tokenizer), ``vision_config(model)``, ``layers``, ``embed``,
    ``final_norm`` and ``dtype``, and may change the defaults ``default_mean`` / ``default_std`` /
    ``resample`` (used where the checkpoint's preprocessor config does not say).
    """

    task_type = "classification"
    resample: int = 2  # PIL.Image.BILINEAR
    default_mean: ClassVar[tuple[float, ...]] = (0.5, 0.5, 0.5)
    default_std: ClassVar[tuple[float, ...]] = (0.5, 0.5, 0.5)

    def __init__(self, model: nn.Module, image_mean: list[float], image_std: list[float]) -> None:
        super().__init__()
        self.model = model
        self.model.requires_grad_(False)
        self.model.eval()
        vc = self.vision_config(model)
        self.image_size = int(vc.image_size)
        self.hidden_size = int(vc.hidden_size)
        self.num_layers = int(vc.num_hidden_layers)
        self.num_heads = int(vc.num_attention_heads)
        self.head_dim = self.hidden_size // self.num_heads
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, prompted_attention)
        # Attention that gets no LayerPrompt (and CLIP's whole text side) runs transformers' SDPA path.
        self.model.set_attn_implementation(ATTENTION_NAME)
        self.register_buffer("mean", torch.tensor(image_mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(image_std).view(1, -1, 1, 1), persistent=False)
        # The collate normalises on the CPU (in loader workers) while the buffers follow the model to the GPU.
        self._cpu_mean_std = (self.mean.clone(), self.std.clone())

    # -- what a subclass provides ------------------------------------------------------------------
    @staticmethod
    def vision_config(model: nn.Module) -> Any:
        """The config holding the image encoder's geometry (image_size, hidden_size, layers, heads)."""
        return model.config

    @classmethod
    @abstractmethod
    def load_model(cls, path: str | Path, dtype: torch.dtype) -> tuple[nn.Module, dict[str, Any]]:
        """The transformers model at ``path`` and further constructor arguments (e.g. CLIP's tokenizer)."""

    @property
    @abstractmethod
    def layers(self) -> nn.ModuleList:
        """The encoder blocks, in order."""

    @abstractmethod
    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[CLS] + patch tokens with position embeddings (B, 1 + N, D), ready for the first block."""

    @abstractmethod
    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The encoder's final normalisation, on every token."""

    # -- shared ------------------------------------------------------------------------------------
    @classmethod
    def from_path(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "PromptableImageEncoder":
        cls.check_files(path)  # the load below is strict: no separate weight check
        try:
            model, extras = cls.load_model(path, dtype)
        except Exception as e:  # noqa: BLE001 - surface as one line naming the path
            name = cls.__name__.removesuffix("Backbone") or cls.__name__
            raise BackboneError(f"cannot load {name} backbone from {path}: {str(e).splitlines()[0]}") from None
        from mcit.data.transforms import PIL_FILTER

        own = cls.own_preprocessing(path)
        bb = cls(model, image_mean=list(own.mean), image_std=list(own.std), **extras)
        bb.resample = PIL_FILTER[own.interpolation]  # the checkpoint's filter
        return bb

    @classmethod
    def own_preprocessing(cls, path: str | Path) -> "BackbonePreprocessing":
        """The checkpoint directory's own inference pipeline, read without loading weights: its
        ``preprocessor_config.json`` (resize, crop, filter, mean / std), the input size from ``config.json``,
        and the class's defaults where the directory says nothing."""
        from mcit.data.transforms import FILTER_NAME, BackbonePreprocessing

        p = Path(path)
        try:
            cfg = json.loads((p / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            cfg = {}
        size = int((cfg.get("vision_config") or cfg).get("image_size", 224))
        default = BackbonePreprocessing(size, None, FILTER_NAME[cls.resample], tuple(cls.default_mean),
                                        tuple(cls.default_std), f"{cls.__name__} defaults")
        proc = read_preprocessor(p) if p.is_dir() else {}
        if not proc:
            return default
        return BackbonePreprocessing.from_image_processor(proc, size, default, str(p / "preprocessor_config.json"))

    def use_normalization(self, mean: tuple[float, ...] | list[float], std: tuple[float, ...] | list[float]) -> None:
        """Normalise with the run's pipeline's mean / std (a preset's ``Normalize``, e.g. an official code base
        that feeds the ViT [0, 1] images) instead of the checkpoint's; every later collate and every method that
        reads ``mean`` / ``std`` (STAR-Prompt's CLIP query) sees the same values."""
        self.mean.copy_(torch.tensor(mean, dtype=self.mean.dtype).view(1, -1, 1, 1))
        self.std.copy_(torch.tensor(std, dtype=self.std.dtype).view(1, -1, 1, 1))
        self._cpu_mean_std = (self.mean.detach().cpu().clone(), self.std.detach().cpu().clone())

    def preprocess(self, images: list) -> torch.Tensor:
        """PIL images -> normalised pixel values (RGB, resized to the model's size)."""
        from mcit.data.transforms import to_tensor

        sized = []
        for im in images:
            im = im.convert("RGB")
            if im.size != (self.image_size, self.image_size):  # a preset that leaves some sizes as they are
                im = im.resize((self.image_size, self.image_size), self.resample)
            sized.append(im)
        mean, std = self._cpu_mean_std
        return to_tensor(sized, mean.flatten().tolist(), std.flatten().tolist())

    def make_collate(self, split: Any, task: int, *, train: bool, label_index: dict[int, int],
                     transform: Callable | None = None) -> Callable:
        """How raw samples of ``split`` become a Batch (classification: images and class indices)."""
        from mcit.data.loader import classification_collate

        return classification_collate(self.collation_view().preprocess, label_index, task, split, transform)

    def encode(self, tokens: torch.Tensor, prompts: dict[int, LayerPrompt] | None = None,
               appended: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Run every block and the final norm (on every token) over a token sequence (B, T, D).

        ``prompts[i]``: block i's LayerPrompt (prefixes, value residual, score rewrite, capture).
        ``appended[i]`` (B, P, D): tokens appended to block i's input and dropped from its output
        (VPT-deep as in VPT-NSP²'s official code: each block gets fresh prompt tokens that only act
        through attention).
        """
        h = tokens
        for i, layer in enumerate(self.layers):
            lp = prompts.get(i) if prompts else None
            extra = appended.get(i) if appended else None
            if extra is not None:
                n = h.shape[1]
                h = layer(torch.cat([h, extra.to(h.dtype)], dim=1), None, mcit_prompt=lp)[:, :n]
            else:
                h = layer(h, None, mcit_prompt=lp)
        return self.final_norm(h)

    def cls_position_embedding(self) -> torch.Tensor | None:
        """The [CLS] token's position embedding (D,), which the L2P code family adds to every inserted
        prompt token; None for CLIP, whose tokens are layer-normalised after the position embedding."""
        return None

    @torch.no_grad()
    def cls_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The frozen pre-trained [CLS] feature (final norm), the usual prompt-selection query."""
        return self.encode(self.embed(pixel_values))[:, 0]
