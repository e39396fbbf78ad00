"""The procedural pre-training images: every shape is drawn where and as large as its class says."""

import numpy as np
import pytest
from PIL import Image, ImageDraw

from mcit.data.procedural import SHAPES, draw_shape

C = 64  # canvas: radius 14-29 px, centre 25.6-38.4 px, strokes 4-8 px


def _ink(shape: str, seed: int) -> np.ndarray:
    img = Image.new("L", (C, C), 0)
    draw_shape(ImageDraw.Draw(img), shape, np.random.RandomState(seed), C)
    return np.asarray(img)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_is_inked_centred_and_within_its_radius(shape):
    for seed in range(6):
        a = _ink(shape, seed)
        ys, xs = np.nonzero(a)
        assert len(xs) > 0, (shape, seed)
        assert a[a > 0].min() >= 170  # ink 170-255 on black
        w, h = xs.max() - xs.min() + 1, ys.max() - ys.min() + 1
        assert max(w, h) <= 2 * 0.45 * C + 2 * (C // 7), (shape, seed, w, h)  # radius at most 0.45 of the canvas
        cx, cy = (xs.max() + xs.min()) / 2, (ys.max() + ys.min()) / 2
        assert 0.4 * C - 6 <= cx <= 0.6 * C + 6, (shape, seed, cx)
        if shape not in ("arc_top", "arc_bottom"):  # half an ellipse: its ink sits above or below the centre
            assert 0.4 * C - 6 <= cy <= 0.6 * C + 6, (shape, seed, cy)
        clipped = xs.min() == 0 or xs.max() == C - 1  # a large shape near the edge runs off the canvas
        if shape in ("hbar", "ring", "disk", "square", "plus", "cross", "dots", "parallel") and not clipped:
            box = a[:, xs.min():xs.max() + 1] > 0
            iou = (box & box[:, ::-1]).sum() / (box | box[:, ::-1]).sum()
            assert iou >= 0.6, (shape, seed, iou)  # mirror-symmetric shapes: the ink mirrored covers itself
        wide = w >= 2 * 0.22 * C - 2
        tall = h >= 2 * 0.22 * C - 2
        if shape == "hbar":
            assert wide and h <= C // 7 + 2, (seed, w, h)
        elif shape == "vbar":
            assert tall and w <= C // 7 + 2, (seed, w, h)
        elif shape in ("arc_top", "arc_bottom", "parallel", "zigzag"):
            assert wide, (shape, seed, w, h)  # half-height shapes
        elif shape == "dots":  # four dots at half the radius
            assert min(w, h) >= 0.22 * C, (seed, w, h)
        else:
            assert wide and tall, (shape, seed, w, h)
