"""Image preprocessing presets: each official code base's train and eval pipeline for a data set, normalisation
included, and the backbone's own inference pipeline, on PIL and torch only.

Why here and not torchvision: torchvision cannot be installed beside the CPU torch these machines use
(``../shared/PLATFORM.md``), and the papers' numbers depend on the exact pipeline (a random-resized crop with
scale (0.05, 1) in l2p-pytorch and its descendants, torchvision's default (0.08, 1) in CODA-Prompt, HiDe-Prompt's
CIFAR recipe and mammoth, AutoAugment before the crop in VPT-NSP²; [0, 1] inputs in the l2p family, CODA-Prompt
and STAR-Prompt's mammoth, CIFAR-100 statistics in HiDe-Prompt's and NoRGa's CIFAR recipe, timm's mean / std of
the model in VPT-NSP²). Each step draws its random numbers in torchvision's order and with its formulas, from a
generator seeded per sample (``sample_generator``): the augmentation a sample gets depends only on the run's seed,
the task, the epoch and the sample's key, never on the rank, the loader worker or whether the run was resumed.
``tests/reference/test_transforms_reference.py`` compares every step with torchvision 0.28 on fixed images and
seeds; ``tests/reference/test_preprocessing_reference.py`` compares every shipped CIL config's train and eval
pipeline with the official repository's own transform code.

A preset is a name valid for ``data.train_transform`` and ``data.eval_transform``; the size is the backbone's
input size (224 in the papers). Its ``normalize`` becomes the backbone's mean / std for the run
(``mcit.run.preflight.image_pipeline``; the train and eval presets must agree). ``backbone``, the default, is the
backbone's own pipeline (``BackbonePreprocessing``: its zoo tag's release, or its directory's image processor).
"""


from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# PIL's resampling codes (Image.Resampling), by the names torchvision's InterpolationMode uses; and back (the
# ``resample`` of a transformers image processor's config is the code).
PIL_FILTER = {"nearest": 0, "bilinear": 2, "bicubic": 3}
FILTER_NAME = {code: name for name, code in PIL_FILTER.items()}


def sample_generator(seed: int, key: str) -> torch.Generator:
    """A generator for one sample's augmentation: a stable hash of (seed, key), not Python's salted hash()."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def _uniform(g: torch.Generator, lo: float, hi: float) -> float:
    return float(torch.empty(1).uniform_(lo, hi, generator=g).item())


def _randint(g: torch.Generator, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi, size=(1,), generator=g).item())


# --------------------------------------------------------------------------------------------------
# Steps (each a frozen dataclass: its fields are the recipe's parameters, compared with the official code).
# A random step draws its parameters (``draw``) and applies them (``apply``) separately, so a test can apply
# the parameters the official code drew; calling a step does both.

class _Step(ABC):
    random = False

    def draw(self, img: Any, g: torch.Generator | None) -> Any:
        return None

    @abstractmethod
    def apply(self, img: Any, params: Any) -> Any:
        """The step on ``img`` with drawn ``params`` (None for a deterministic step)."""

    def __call__(self, img: Any, g: torch.Generator | None = None) -> Any:
        return self.apply(img, self.draw(img, g) if self.random else None)

@dataclass(frozen=True)
class RandomResizedCrop(_Step):
    """torchvision's RandomResizedCrop: up to 10 tries of (area fraction, log-uniform aspect ratio), else the
    central crop clamped to ``ratio``; then a resize to ``size`` x ``size``."""

    size: int
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)
    interpolation: str = "bilinear"
    random = True

    def params(self, width: int, height: int, g: torch.Generator) -> tuple[int, int, int, int]:
        """(top, left, height, width) of the crop: torchvision's ``get_params``."""
        area = height * width
        log_ratio = torch.log(torch.tensor(self.ratio))  # float32, as torchvision computes it
        for _ in range(10):
            target_area = area * _uniform(g, self.scale[0], self.scale[1])
            aspect = float(torch.exp(torch.empty(1).uniform_(float(log_ratio[0]), float(log_ratio[1]),
                                                              generator=g)).item())
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return _randint(g, 0, height - h + 1), _randint(g, 0, width - w + 1), h, w
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h, w = height, int(round(height * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def draw(self, img: Any, g: torch.Generator | None) -> tuple[int, int, int, int]:
        return self.params(img.width, img.height, _need(g, self))

    def apply(self, img: Any, box: tuple[int, int, int, int]) -> Any:
        top, left, h, w = box
        return img.crop((left, top, left + w, top + h)).resize((self.size, self.size), PIL_FILTER[self.interpolation])

    def describe(self) -> dict[str, Any]:
        return {"op": "RandomResizedCrop", "size": [self.size, self.size], "scale": list(self.scale),
                "ratio": list(self.ratio), "interpolation": self.interpolation}


@dataclass(frozen=True)
class RandomHorizontalFlip(_Step):
    p: float = 0.5
    random = True

    def draw(self, img: Any, g: torch.Generator | None) -> bool:
        return float(torch.rand(1, generator=_need(g, self)).item()) < self.p

    def apply(self, img: Any, flip: bool) -> Any:
        return img.transpose(0) if flip else img  # Image.Transpose.FLIP_LEFT_RIGHT

    def describe(self) -> dict[str, Any]:
        return {"op": "RandomHorizontalFlip", "p": self.p}


@dataclass(frozen=True)
class Resize(_Step):
    """An int resizes the shorter side (the longer one ``int(size * long / short)``); a pair is (height, width)."""

    size: int | tuple[int, int]
    interpolation: str = "bilinear"
    random = False

    def apply(self, img: Any, params: None = None) -> Any:
        w, h = img.size
        if isinstance(self.size, int):
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = self.size, int(self.size * long / short)
            new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
        else:
            new_h, new_w = self.size
        if (new_w, new_h) == (w, h):
            return img
        return img.resize((new_w, new_h), PIL_FILTER[self.interpolation])

    def describe(self) -> dict[str, Any]:
        return {"op": "Resize", "size": self.size if isinstance(self.size, int) else list(self.size),
                "interpolation": self.interpolation}


@dataclass(frozen=True)
class CenterCrop(_Step):
    """The central ``size`` x ``size`` window (zero-padded first where the image is smaller, as torchvision)."""

    size: int
    random = False

    def apply(self, img: Any, params: None = None) -> Any:
        from PIL import Image

        w, h = img.size
        if w < self.size or h < self.size:
            pw, ph = max(self.size, w), max(self.size, h)
            canvas = Image.new(img.mode, (pw, ph))
            left, top = (self.size - w) // 2 if w < self.size else 0, (self.size - h) // 2 if h < self.size else 0
            canvas.paste(img, (left, top))
            img, (w, h) = canvas, (pw, ph)
            if (w, h) == (self.size, self.size):
                return img
        top, left = int(round((h - self.size) / 2.0)), int(round((w - self.size) / 2.0))
        return img.crop((left, top, left + self.size, top + self.size))

    def describe(self) -> dict[str, Any]:
        return {"op": "CenterCrop", "size": [self.size, self.size]}


# AutoAugment's learned policies (Cubuk et al. 2019), as torchvision 0.28 tabulates them
# (torchvision/transforms/autoaugment.py, AutoAugment._get_policies): (op, probability, magnitude bin).
_AUTOAUGMENT_POLICIES: dict[str, tuple[tuple[tuple[str, float, int | None], ...], ...]] = {
    "imagenet": (
        (("Posterize", 0.4, 8), ("Rotate", 0.6, 9)), (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
        (("Equalize", 0.8, None), ("Equalize", 0.6, None)), (("Posterize", 0.6, 7), ("Posterize", 0.6, 6)),
        (("Equalize", 0.4, None), ("Solarize", 0.2, 4)), (("Equalize", 0.4, None), ("Rotate", 0.8, 8)),
        (("Solarize", 0.6, 3), ("Equalize", 0.6, None)), (("Posterize", 0.8, 5), ("Equalize", 1.0, None)),
        (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)), (("Equalize", 0.6, None), ("Posterize", 0.4, 6)),
        (("Rotate", 0.8, 8), ("Color", 0.4, 0)), (("Rotate", 0.4, 9), ("Equalize", 0.6, None)),
        (("Equalize", 0.0, None), ("Equalize", 0.8, None)), (("Invert", 0.6, None), ("Equalize", 1.0, None)),
        (("Color", 0.6, 4), ("Contrast", 1.0, 8)), (("Rotate", 0.8, 8), ("Color", 1.0, 2)),
        (("Color", 0.8, 8), ("Solarize", 0.8, 7)), (("Sharpness", 0.4, 7), ("Invert", 0.6, None)),
        (("ShearX", 0.6, 5), ("Equalize", 1.0, None)), (("Color", 0.4, 0), ("Equalize", 0.6, None)),
        (("Equalize", 0.4, None), ("Solarize", 0.2, 4)), (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
        (("Invert", 0.6, None), ("Equalize", 1.0, None)), (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
        (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
    ),
    "cifar10": (
        (("Invert", 0.1, None), ("Contrast", 0.2, 6)), (("Rotate", 0.7, 2), ("TranslateX", 0.3, 9)),
        (("Sharpness", 0.8, 1), ("Sharpness", 0.9, 3)), (("ShearY", 0.5, 8), ("TranslateY", 0.7, 9)),
        (("AutoContrast", 0.5, None), ("Equalize", 0.9, None)), (("ShearY", 0.2, 7), ("Posterize", 0.3, 7)),
        (("Color", 0.4, 3), ("Brightness", 0.6, 7)), (("Sharpness", 0.3, 9), ("Brightness", 0.7, 9)),
        (("Equalize", 0.6, None), ("Equalize", 0.5, None)), (("Contrast", 0.6, 7), ("Sharpness", 0.6, 5)),
        (("Color", 0.7, 7), ("TranslateX", 0.5, 8)), (("Equalize", 0.3, None), ("AutoContrast", 0.4, None)),
        (("TranslateY", 0.4, 3), ("Sharpness", 0.2, 6)), (("Brightness", 0.9, 6), ("Color", 0.2, 8)),
        (("Solarize", 0.5, 2), ("Invert", 0.0, None)), (("Equalize", 0.2, None), ("AutoContrast", 0.6, None)),
        (("Equalize", 0.2, None), ("Equalize", 0.6, None)), (("Color", 0.9, 9), ("Equalize", 0.6, None)),
        (("AutoContrast", 0.8, None), ("Solarize", 0.2, 8)), (("Brightness", 0.1, 3), ("Color", 0.7, 0)),
        (("Solarize", 0.4, 5), ("AutoContrast", 0.9, None)), (("TranslateY", 0.9, 9), ("TranslateY", 0.7, 9)),
        (("AutoContrast", 0.9, None), ("Solarize", 0.8, 3)), (("Equalize", 0.8, None), ("Invert", 0.1, None)),
        (("TranslateY", 0.7, 9), ("AutoContrast", 0.9, None)),
    ),
}


def magnitudes(op: str, width: int, height: int) -> tuple[torch.Tensor, bool]:
    """The 10 magnitude bins of an op and whether it is signed (torchvision's float32 linspace values)."""
    lin = lambda hi: torch.linspace(0.0, hi, 10)  # noqa: E731
    table: dict[str, tuple[torch.Tensor, bool]] = {
        "ShearX": (lin(0.3), True), "ShearY": (lin(0.3), True),
        "TranslateX": (lin(150.0 / 331.0 * width), True), "TranslateY": (lin(150.0 / 331.0 * height), True),
        "Rotate": (lin(30.0), True), "Brightness": (lin(0.9), True), "Color": (lin(0.9), True),
        "Contrast": (lin(0.9), True), "Sharpness": (lin(0.9), True),
        "Posterize": (8 - (torch.arange(10) / ((10 - 1) / 4)).round().int(), False),
        "Solarize": (torch.linspace(255.0, 0.0, 10), False),
    }
    return table.get(op, (torch.tensor(0.0), False))


def _affine(img: Any, *, angle: float = 0.0, translate: tuple[int, int] = (0, 0),
            shear: tuple[float, float] = (0.0, 0.0), center: tuple[float, float] | None = None,
            interpolation: str) -> Any:
    """An affine warp about ``center`` (the image centre by default) with zero fill: the inverse matrix
    (rotation, shear in degrees, translation in pixels) that PIL's Image.transform samples with."""
    from PIL import Image

    cx, cy = center if center is not None else (img.width * 0.5, img.height * 0.5)
    rot, sx, sy = math.radians(angle), math.radians(shear[0]), math.radians(shear[1])
    a = math.cos(rot - sy) / math.cos(sy)
    b = -math.cos(rot - sy) * math.tan(sx) / math.cos(sy) - math.sin(rot)
    c = math.sin(rot - sy) / math.cos(sy)
    d = -math.sin(rot - sy) * math.tan(sx) / math.cos(sy) + math.cos(rot)
    m = [d, -b, 0.0, -c, a, 0.0]
    tx, ty = translate
    m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty) + cx
    m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty) + cy
    fill = tuple([0] * len(img.getbands())) if len(img.getbands()) > 1 else 0
    return img.transform(img.size, Image.AFFINE, m, PIL_FILTER[interpolation], fillcolor=fill)


def apply_op(img: Any, op: str, magnitude: float, interpolation: str) -> Any:
    from PIL import ImageEnhance, ImageOps

    if op == "ShearX":
        return _affine(img, shear=(math.degrees(math.atan(magnitude)), 0.0), center=(0.0, 0.0),
                       interpolation=interpolation)
    if op == "ShearY":
        return _affine(img, shear=(0.0, math.degrees(math.atan(magnitude))), center=(0.0, 0.0),
                       interpolation=interpolation)
    if op == "TranslateX":
        return _affine(img, translate=(int(magnitude), 0), interpolation=interpolation)
    if op == "TranslateY":
        return _affine(img, translate=(0, int(magnitude)), interpolation=interpolation)
    if op == "Rotate":
        fill = tuple([0] * len(img.getbands())) if len(img.getbands()) > 1 else 0
        return img.rotate(magnitude, PIL_FILTER[interpolation], False, None, fillcolor=fill)
    enhance = {"Brightness": ImageEnhance.Brightness, "Color": ImageEnhance.Color,
               "Contrast": ImageEnhance.Contrast, "Sharpness": ImageEnhance.Sharpness}
    if op in enhance:
        return enhance[op](img).enhance(1.0 + magnitude)
    if op == "Posterize":
        return ImageOps.posterize(img, int(magnitude))
    if op == "Solarize":
        return ImageOps.solarize(img, magnitude)
    if op == "AutoContrast":
        return ImageOps.autocontrast(img)
    if op == "Equalize":
        return ImageOps.equalize(img)
    if op == "Invert":
        return ImageOps.invert(img)
    raise ValueError(f"unknown AutoAugment op {op!r}")


@dataclass(frozen=True)
class AutoAugment(_Step):
    """torchvision's AutoAugment: one of the policy's 25 sub-policies, each of its two ops applied with its
    probability, a signed magnitude negated with probability 1/2."""

    policy: str = "imagenet"
    interpolation: str = "nearest"
    random = True

    def draw(self, img: Any, g: torch.Generator | None) -> tuple[int, list[float], list[int]]:
        """(sub-policy, the two ops' probabilities, their signs): torchvision's ``get_params``."""
        g = _need(g, self)
        pick = int(torch.randint(len(_AUTOAUGMENT_POLICIES[self.policy]), (1,), generator=g).item())
        probs = torch.rand((2,), generator=g)
        signs = torch.randint(2, (2,), generator=g)
        return pick, probs.tolist(), signs.tolist()

    def apply(self, img: Any, params: tuple[int, list[float], list[int]]) -> Any:
        pick, probs, signs = params
        for i, (op, p, bin_) in enumerate(_AUTOAUGMENT_POLICIES[self.policy][pick]):
            if torch.tensor(probs[i], dtype=torch.float32) <= p:  # torchvision compares the float32 draw
                mags, signed = magnitudes(op, img.width, img.height)
                magnitude = float(mags[bin_].item()) if bin_ is not None else 0.0
                if signed and signs[i] == 0:
                    magnitude *= -1.0
                img = apply_op(img, op, magnitude, self.interpolation)
        return img

    def describe(self) -> dict[str, Any]:
        return {"op": "AutoAugment", "policy": self.policy, "interpolation": self.interpolation}


@dataclass(frozen=True)
class ColorJitter(_Step):
    """torchvision's ColorJitter on PIL: each factor uniform in its range (``brightness=b`` is
    [max(0, 1 - b), 1 + b], as torchvision's ``_check_input``), applied in a random order (``randperm(4)``
    drawn first). Hue is not implemented (no shipped recipe uses it) and is refused."""

    brightness: tuple[float, float] | None = None
    contrast: tuple[float, float] | None = None
    saturation: tuple[float, float] | None = None
    random = True

    @staticmethod
    def range(b: float) -> tuple[float, float]:
        """torchvision's range for a number ``b``."""
        return (max(0.0, 1.0 - b), 1.0 + b)

    def draw(self, img: Any, g: torch.Generator | None) -> tuple[list[int], list[float | None]]:
        g = _need(g, self)
        order = torch.randperm(4, generator=g).tolist()
        factors = [None if r is None else float(torch.empty(1).uniform_(r[0], r[1], generator=g).item())
                   for r in (self.brightness, self.contrast, self.saturation)]
        return order, factors

    def apply(self, img: Any, params: tuple[list[int], list[float | None]]) -> Any:
        from PIL import ImageEnhance

        order, factors = params
        enhance = (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color)
        for i in order:
            if i < 3 and factors[i] is not None:
                img = enhance[i](img).enhance(factors[i])
        return img

    def describe(self) -> dict[str, Any]:
        r = lambda v: None if v is None else list(v)  # noqa: E731
        return {"op": "ColorJitter", "brightness": r(self.brightness), "contrast": r(self.contrast),
                "saturation": r(self.saturation), "hue": None}


def _need(g: torch.Generator | None, step: Any) -> torch.Generator:
    if g is None:
        raise ValueError(f"{type(step).__name__} is random and was given no per-sample generator")
    return g


# --------------------------------------------------------------------------------------------------
# Pipelines and presets

@dataclass(frozen=True)
class Compose:
    """Steps in order; each random step draws its parameters from the sample's generator just before it runs."""

    steps: tuple = ()

    @property
    def random(self) -> bool:
        return any(s.random for s in self.steps)

    def __call__(self, img: Any, g: torch.Generator | None = None) -> Any:
        if not self.steps:
            return img
        img = img.convert("RGB")  # every official loader opens images as RGB before its transforms
        for step in self.steps:
            img = step(img, g)
        return img

    def replay(self, img: Any, params: list[Any]) -> Any:
        """The pipeline with given parameters for its random steps, in order (what another implementation drew)."""
        it = iter(params)
        img = img.convert("RGB")
        for step in self.steps:
            img = step.apply(img, next(it) if step.random else None)
        return img

    def describe(self) -> list[dict[str, Any]]:
        """Each step's parameters, named as torchvision names them."""
        return [s.describe() for s in self.steps]


Norm = tuple[tuple[float, ...], tuple[float, ...]]
NO_NORM: Norm = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # ToTensor only: inputs in [0, 1]
CIFAR100_NORM: Norm = ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))
IMAGENET_NORM: Norm = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
CLIP_NORM: Norm = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


@dataclass(frozen=True)
class BackbonePreprocessing:
    """A checkpoint's own inference pipeline: the shorter side resized to ``resize`` and the central
    ``size`` x ``size`` crop (``resize`` None: the whole image resized to ``size`` x ``size``, as
    transformers' ViT image processor does), then ``mean`` / ``std``. What a config without a preset gets:
    the model sees images as its pre-training evaluated them, not a squashed picture with a paper's
    normalisation."""

    size: int
    resize: int | None
    interpolation: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str = ""

    def steps(self) -> Compose:
        if self.resize is None:
            return Compose((Resize((self.size, self.size), self.interpolation),))
        return Compose((Resize(self.resize, self.interpolation), CenterCrop(self.size)))

    @classmethod
    def from_image_processor(cls, cfg: dict[str, Any], size: int, default: "BackbonePreprocessing",
                             source: str) -> "BackbonePreprocessing":
        """From a transformers ``preprocessor_config.json``: ``size: {shortest_edge}`` with ``do_center_crop``
        and ``crop_size`` (CLIP's processor) is a resize of the shorter side and a centre crop; ``size:
        {height, width}`` (ViT's) resizes the whole image; missing keys keep ``default``'s."""
        interpolation = FILTER_NAME.get(int(cfg.get("resample", -1)), default.interpolation)
        mean = tuple(float(v) for v in cfg.get("image_mean", default.mean))
        std = tuple(float(v) for v in cfg.get("image_std", default.std))
        sz = cfg.get("size")
        resize: int | None = default.resize
        if isinstance(sz, dict) and "shortest_edge" in sz and cfg.get("do_center_crop", True) and cfg.get("crop_size"):
            resize = int(sz["shortest_edge"])
            crop = cfg["crop_size"]
            size = int(crop["height"]) if isinstance(crop, dict) else int(crop)
        elif isinstance(sz, dict) and "height" in sz:
            resize = None
        return cls(size, resize, interpolation, mean, std, source)


@dataclass(frozen=True)
class Preset:
    """One code base's recipe for some data sets: ``train(size)`` and ``evaluate(size)`` build the PIL
    pipelines, ``normalize`` is the mean / std its ``Normalize`` uses (None: the backbone's own, where the
    official code reads it from the loaded model, as VPT-NSP²'s from timm's ``pretrained_cfg``); ``source``
    says where it comes from (repository, commit, function) and for which data sets."""

    name: str
    source: str
    train: Callable[[int], Compose] = field(repr=False)
    evaluate: Callable[[int], Compose] = field(repr=False)
    normalize: Norm | None


def _l2p_eval(size: int) -> Compose:
    """l2p-pytorch build_transform(is_train=False): Resize(int(256 / 224 * size), bicubic) + CenterCrop(size)
    above 32 pixels; ToTensor only at or below."""
    if size <= 32:
        return Compose()
    return Compose((Resize(int((256 / 224) * size), "bicubic"), CenterCrop(size)))


def _l2p_train(size: int) -> Compose:
    return Compose((RandomResizedCrop(size, (0.05, 1.0), (3.0 / 4.0, 4.0 / 3.0), "bilinear"),
                    RandomHorizontalFlip(0.5)))


def _resize_crop(size: int, interpolation: str) -> Compose:
    """Resize(int(256 / 224 * size)) of the shorter side, then the central crop."""
    return Compose((Resize(int(256 / 224 * size), interpolation), CenterCrop(size)))


def _star_train(size: int) -> Compose:
    return Compose((RandomResizedCrop(size, interpolation="bicubic"), RandomHorizontalFlip(0.5)))


BACKBONE = "backbone"  # the preset name of the backbone's own pipeline (the default)

PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset(BACKBONE, "the backbone's own inference pipeline (its zoo tag's pre-training evaluation, or its "
                     "checkpoint's preprocessor config): resize, centre crop, mean / std; no augmentation",
           lambda size: Compose(), lambda size: Compose(), None),
    Preset("l2p", "JH-LEE-KR/l2p-pytorch datasets.py build_transform (the same function in dualprompt-pytorch, the "
                  "PGP and Soft-TF repositories, and in thu-ml/HiDe-Prompt and NoRGa for their non-CIFAR data sets); "
                  "no Normalize: inputs in [0, 1]",
           _l2p_train, _l2p_eval, NO_NORM),
    Preset("hide_cifar", "thu-ml/HiDe-Prompt datasets.py build_cifar_transform (the same function in "
                         "Minhchuyentoancbn/MoE_PromptCL, NoRGa), CIFAR-100: RandomResizedCrop(224, bicubic) with "
                         "torchvision's default scale (the function's scale (0.05, 1) is never passed), flip, "
                         "ColorJitter(brightness=63/255); CIFAR-100 mean / std",
           lambda size: Compose((RandomResizedCrop(size, interpolation="bicubic"), RandomHorizontalFlip(0.5),
                                 ColorJitter(brightness=ColorJitter.range(63 / 255)))),
           lambda size: _resize_crop(size, "bicubic"), CIFAR100_NORM),
    Preset("coda", "GT-RIPL/CODA-Prompt 6417d4f dataloaders/utils.py get_transform, CIFAR-100 (the else branch): "
                   "RandomResizedCrop(224) + flip; Resize(224) of the shorter side, no crop; Normalize((0, 0, 0), "
                   "(1, 1, 1)) (the data set's statistics are commented out)",
           lambda size: Compose((RandomResizedCrop(size), RandomHorizontalFlip(0.5))),
           lambda size: Compose((Resize(size, "bilinear"),)), NO_NORM),
    Preset("coda_imagenet", "GT-RIPL/CODA-Prompt 6417d4f dataloaders/utils.py get_transform, ImageNet_R and DomainNet "
                            "(`dataset.startswith('ImageNet') or dataset == 'DomainNet'`): RandomResizedCrop(224) "
                            "+ flip; Resize(256) of the shorter side + CenterCrop(224); inputs in [0, 1]",
           lambda size: Compose((RandomResizedCrop(size), RandomHorizontalFlip(0.5))),
           lambda size: _resize_crop(size, "bilinear"), NO_NORM),
    Preset("vpt_nsp2_cifar", "zugexiaodui/VPTinNSforCL utils/dataset_builder.py define_dataset, transform_type "
                             "'autoaug' (the scripts' default), cifar100; timm's mean / std of the model",
           lambda size: Compose((AutoAugment("cifar10", "bilinear"), RandomResizedCrop(size, interpolation="bicubic"))),
           lambda size: Compose((Resize((size, size), "bicubic"),)), None),
    Preset("vpt_nsp2_imagenet", "zugexiaodui/VPTinNSforCL utils/dataset_builder.py define_dataset, transform_type "
                                "'autoaug', imagenet_r / sdomainet; timm's mean / std of the model",
           lambda size: Compose((AutoAugment("imagenet", "bilinear"),
                                 RandomResizedCrop(size, interpolation="bilinear"))),
           lambda size: Compose((Resize((int(256 / 224 * size), int(256 / 224 * size)), "bilinear"),
                                 CenterCrop(size))),
           None),
    Preset("vpt_nsp2_clip_cifar", "zugexiaodui/VPTinNSforCL utils/dataset_builder.py define_dataset, transform_type "
                                  "'clip' (its CLIP scripts), cifar100: AutoAugment + crop, then CLIP's preprocess "
                                  "(its resize and crop leave the crop as it is); the CLIP's own mean / std",
           lambda size: Compose((AutoAugment("cifar10", "bilinear"), RandomResizedCrop(size, interpolation="bicubic"),
                                 Resize(size, "bicubic"), CenterCrop(size))),
           lambda size: Compose((Resize(size, "bicubic"), CenterCrop(size))), None),
    Preset("vpt_nsp2_clip_imagenet", "zugexiaodui/VPTinNSforCL utils/dataset_builder.py define_dataset, transform_type "
                                     "'clip', imagenet_r / sdomainet; the CLIP's own mean / std",
           lambda size: Compose((AutoAugment("imagenet", "bilinear"), RandomResizedCrop(size, interpolation="bilinear"),
                                 Resize(size, "bicubic"), CenterCrop(size))),
           lambda size: Compose((Resize(size, "bicubic"), CenterCrop(size))), None),
    Preset("clip", "openai/CLIP d05afc4 clip.py _transform(224): Resize(224, bicubic) of the shorter side + "
                   "CenterCrop(224), CLIP's mean / std, for every image (zero-shot CLIP trains nothing)",
           lambda size: Compose((Resize(size, "bicubic"), CenterCrop(size))),
           lambda size: Compose((Resize(size, "bicubic"), CenterCrop(size))), CLIP_NORM),
    Preset("star_cifar", "aimagelab/mammoth d003b9a (2024-08-16, the code STAR-Prompt's results were released with; "
                         "the same since c5331d2, 2024-07-10) datasets/seq_cifar100_224.py TRANSFORM / TEST_TRANSFORM: "
                         "RandomResizedCrop(224, bicubic) + flip; Resize(224, bicubic) of the shorter side; "
                         "Normalize((0, 0, 0), (1, 1, 1))",
           _star_train, lambda size: Compose((Resize(size, "bicubic"),)), NO_NORM),
    Preset("star_cifar_imagenet_norm", "aimagelab/mammoth 210c6bc (2024-08-19) and later, up to e75a491: star_cifar's "
                                       "steps with ImageNet's mean / std (what mammoth runs today)",
           _star_train, lambda size: Compose((Resize(size, "bicubic"),)), IMAGENET_NORM),
    Preset("star_imagenet_r", "aimagelab/mammoth d003b9a and 210c6bc (unchanged through e75a491) "
                              "datasets/seq_imagenet_r.py TRANSFORM / TEST_TRANSFORM: RandomResizedCrop(224, bicubic) "
                              "+ flip; Resize((256, 256), bicubic) + CenterCrop(224); Normalize((0, 0, 0), (1, 1, 1))",
           _star_train,
           lambda size: Compose((Resize((int(256 / 224 * size), int(256 / 224 * size)), "bicubic"),
                                 CenterCrop(size))),
           NO_NORM),
]}


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown transform preset {name!r} (have: {', '.join(PRESETS)})")
    return PRESETS[name]


def to_tensor(images: list[Any], mean: tuple[float, ...] | list[float],
              std: tuple[float, ...] | list[float]) -> torch.Tensor:
    """RGB PIL images of one size -> (B, 3, H, W) float32: torchvision's ToTensor (x / 255) then
    Normalize(mean, std)."""
    import numpy as np

    x = torch.from_numpy(np.stack([np.asarray(im, dtype=np.float32) / 255.0 for im in images]))
    x = x.permute(0, 3, 1, 2)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return ((x - m) / s).contiguous()


def build(name: str, *, train: bool, size: int, backbone: BackbonePreprocessing | None = None) -> Compose:
    """The preset's train or eval pipeline (PIL steps) for input size ``size``; the ``backbone`` preset is
    ``backbone``'s own pipeline (no augmentation at train time either)."""
    preset = _preset(name)
    if name == BACKBONE:
        return backbone.steps() if backbone is not None else Compose()
    return preset.train(size) if train else preset.evaluate(size)


def normalization(name: str, backbone: BackbonePreprocessing | None) -> Norm | None:
    """The mean / std the preset's ``Normalize`` uses; the backbone's own where the preset defers to it
    (None when that is not known: a backbone that normalises by itself)."""
    norm = _preset(name).normalize
    if norm is not None:
        return norm
    return (tuple(backbone.mean), tuple(backbone.std)) if backbone is not None else None
