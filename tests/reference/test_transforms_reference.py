"""The augmentation presets against torchvision 0.28 itself (official/transforms_torchvision.json, produced outside
the repository; its "source" says how). Same images, same seeds: every output must be byte-identical, so a
preset draws the same crops, flips and AutoAugment sub-policies as the official loaders would."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mcit.data import transforms as X

REF = json.loads((Path(__file__).parent / "official" / "transforms_torchvision.json").read_text())


def _images() -> dict[str, Image.Image]:
    out = {}
    for name, (w, h) in {"wide": (64, 40), "tall": (30, 52), "square": (32, 32), "big": (300, 260)}.items():
        y, x = np.mgrid[0:h, 0:w]
        arr = np.stack([(x * 7 + y * 3) % 256, (x * y) % 256, (255 - x * 5 + y * 11) % 256], -1).astype("uint8")
        out[name] = Image.fromarray(arr, "RGB")
    return out


def _sha(img: Image.Image) -> str:
    return hashlib.sha256(img.tobytes()).hexdigest()


@pytest.mark.parametrize("preset", sorted({c["preset"] for c in REF["cases"]}))
def test_preset_outputs_equal_torchvision_byte_for_byte(preset):
    ims = _images()
    cases = [c for c in REF["cases"] if c["preset"] == preset]
    assert len(cases) == 4 * 13
    bad = []
    for c in cases:
        g = None if c["seed"] is None else torch.Generator().manual_seed(c["seed"])
        out = X.build(preset, train=c["train"], size=REF["size"])(ims[c["image"]], g)
        if _sha(out) != c["sha256"] or list(out.size) != c["size"]:
            bad.append((c["train"], c["image"], c["seed"], list(out.size), c["size"]))
    assert not bad, f"{preset}: {len(bad)} of {len(cases)} differ from torchvision (train, image, seed, ours, theirs): {bad[:5]}"


def test_every_autoaugment_op_equals_torchvision_at_its_bins_and_signs():
    wide = _images()["wide"]
    bad = []
    for c in REF["ops"]:
        mags, _ = X.magnitudes(c["op"], wide.width, wide.height)
        m = float(mags[c["bin"]].item()) * c["sign"] if c["bin"] is not None else 0.0
        if _sha(X.apply_op(wide, c["op"], m, c["interpolation"])) != c["sha256"]:
            bad.append((c["op"], c["bin"], c["sign"], c["interpolation"]))
    assert len(REF["ops"]) == 126 and not bad, bad
