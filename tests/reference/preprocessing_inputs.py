"""The fixed images and the tensor record behind ``official/preprocessing.json``.

Both sides use this file: the scratch scripts that ran each official repository's transform code with
torchvision (outside this repository) and ``test_preprocessing_reference.py``. Only numpy, PIL and hashlib,
so a scratch folder can import it as it is.

A record of a (3, H, W) float tensor that ended in ``Normalize(mean, std)``: the sha256 of the uint8 image it
was made from (``round((t * std + mean) * 255)``, HWC: equal pixels everywhere, so crop boxes, resize filters
and flips agree exactly), 64 of its values at fixed positions and the per-channel mean and standard deviation
in float64 (the arithmetic of the normalisation itself, compared to 1e-5).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

SIZES = {"cifar": (32, 32), "small": (64, 40), "tall": (240, 320), "wide": (500, 333)}  # (width, height)
N_SAMPLES = 64


def images() -> dict[str, Any]:
    """Four RGB images: CIFAR's 32 x 32, one below 224 on both sides, a portrait and a landscape photo size.
    Every pixel differs from its neighbours in some channel, so any difference in crop, filter or flip shows."""
    from PIL import Image

    out = {}
    for name, (w, h) in SIZES.items():
        y, x = np.mgrid[0:h, 0:w]
        arr = np.stack([(x * 7 + y * 3) % 256, (x * y + 17 * (x // 9)) % 256,
                        (255 - x * 5 + y * 11 + 40 * ((x // 13 + y // 11) % 2)) % 256], -1).astype("uint8")
        out[name] = Image.fromarray(arr, "RGB")
    return out


def sample_positions(n: int) -> np.ndarray:
    """64 fixed positions of a flattened tensor of ``n`` values (every 4th of 256 drawn with numpy's seed 0)."""
    return np.sort(np.random.RandomState(0).choice(n, 256, replace=False))[::4]


def pixels(t: np.ndarray, mean: list[float], std: list[float]) -> np.ndarray:
    """The uint8 HWC image a normalised (3, H, W) tensor was made from."""
    m = np.asarray(mean, dtype=np.float64).reshape(3, 1, 1)
    s = np.asarray(std, dtype=np.float64).reshape(3, 1, 1)
    raw = (t.astype(np.float64) * s + m) * 255.0
    px = np.rint(raw)
    if np.abs(raw - px).max() > 1e-2 or px.min() < 0 or px.max() > 255:
        raise ValueError("tensor is not Normalize(ToTensor(uint8 image), mean, std)")
    return px.astype(np.uint8).transpose(1, 2, 0)


def record(t: np.ndarray, mean: list[float], std: list[float]) -> dict[str, Any]:
    t = np.asarray(t, dtype=np.float32)
    flat = t.reshape(-1)
    return {"shape": list(t.shape),
            "pixels_sha256": hashlib.sha256(np.ascontiguousarray(pixels(t, mean, std)).tobytes()).hexdigest(),
            "samples": [float(v) for v in flat[sample_positions(flat.size)]],
            "channel_mean": [float(v) for v in t.astype(np.float64).mean(axis=(1, 2))],
            "channel_std": [float(v) for v in t.astype(np.float64).std(axis=(1, 2))]}
