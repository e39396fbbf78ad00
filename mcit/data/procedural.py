"""Procedurally generated stroke images for pre-training the project's own tiny backbones.

No network and no real data set: 16 shape classes (bars, arcs, rings, corners, crosses, ...) drawn
with random position, scale, thickness, intensity and noise. None of them is a digit, so a backbone
pre-trained here shares no classes with the embedded continual benchmark, as an ImageNet backbone
shares none with most CIL benchmarks.
"""

from __future__ import annotations

import numpy as np

SHAPES = ["hbar", "vbar", "diag_up", "diag_down", "ring", "disk", "square", "plus", "cross", "arc_top",
          "arc_bottom", "corner", "triangle", "parallel", "dots", "zigzag"]


def draw_shape(draw, shape: str, rng: np.random.RandomState, canvas: int) -> None:  # draw: a PIL ImageDraw
    """One ``shape`` on a ``canvas`` square: centred in its middle fifth, radius 0.22-0.45 of the canvas,
    strokes canvas/16 to canvas/7 wide, ink 170-255 (the class is the shape, never its placement)."""
    c = canvas
    cx, cy = rng.uniform(0.4, 0.6, size=2) * c
    r = rng.uniform(0.22, 0.45) * c
    w = int(rng.randint(max(1, c // 16), max(2, c // 7)))
    ink = int(rng.randint(170, 256))
    box = [cx - r, cy - r, cx + r, cy + r]
    line = lambda pts: draw.line(pts, fill=ink, width=w)  # noqa: E731
    if shape == "hbar":
        line([(cx - r, cy), (cx + r, cy)])
    elif shape == "vbar":
        line([(cx, cy - r), (cx, cy + r)])
    elif shape == "diag_up":
        line([(cx - r, cy + r), (cx + r, cy - r)])
    elif shape == "diag_down":
        line([(cx - r, cy - r), (cx + r, cy + r)])
    elif shape == "ring":
        draw.ellipse(box, outline=ink, width=w)
    elif shape == "disk":
        draw.ellipse(box, fill=ink)
    elif shape == "square":
        draw.rectangle(box, outline=ink, width=w)
    elif shape == "plus":
        line([(cx - r, cy), (cx + r, cy)])
        line([(cx, cy - r), (cx, cy + r)])
    elif shape == "cross":
        line([(cx - r, cy - r), (cx + r, cy + r)])
        line([(cx - r, cy + r), (cx + r, cy - r)])
    elif shape == "arc_top":
        draw.arc(box, 180, 360, fill=ink, width=w)
    elif shape == "arc_bottom":
        draw.arc(box, 0, 180, fill=ink, width=w)
    elif shape == "corner":
        line([(cx - r, cy - r), (cx - r, cy + r), (cx + r, cy + r)])
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], outline=ink, width=w)
    elif shape == "parallel":
        line([(cx - r, cy - r / 2), (cx + r, cy - r / 2)])
        line([(cx - r, cy + r / 2), (cx + r, cy + r / 2)])
    elif shape == "dots":
        for dx in (-r / 2, r / 2):
            for dy in (-r / 2, r / 2):
                draw.ellipse([cx + dx - w, cy + dy - w, cx + dx + w, cy + dy + w], fill=ink)
    elif shape == "zigzag":
        pts = [(cx - r + 2 * r * k / 4, cy + (r / 2 if k % 2 else -r / 2)) for k in range(5)]
        line(pts)
    else:  # pragma: no cover - SHAPES is closed
        raise ValueError(shape)


def generate(n: int, size: int = 16, seed: int = 0, canvas: int = 32, low_res: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images (uint8, n x size x size, white strokes on black) and their shape labels.

    With ``low_res`` the drawing is first reduced to low_res x low_res (area averaging) and then
    scaled up, giving the thick, blurred strokes of small scanned images such as 8x8 digits.
    """
    from PIL import Image, ImageDraw

    rng = np.random.RandomState(seed)
    labels = rng.randint(0, len(SHAPES), size=n)
    out = np.empty((n, size, size), dtype=np.uint8)
    for i, lab in enumerate(labels):
        img = Image.new("L", (canvas, canvas), 0)
        draw_shape(ImageDraw.Draw(img), SHAPES[lab], rng, canvas)
        angle = rng.uniform(-20, 20)
        img = img.rotate(angle, resample=Image.BILINEAR)
        if low_res:
            img = img.resize((low_res, low_res), Image.BOX)
        arr = np.asarray(img.resize((size, size), Image.BILINEAR), dtype=np.float32)
        arr += rng.normal(0, 12, size=arr.shape)
        out[i] = np.clip(arr, 0, 255).astype(np.uint8)
    return out, labels.astype(np.int64)


def to_pixel_values(images_uint8: np.ndarray, mean: float = 0.5, std: float = 0.5):
    """(n, h, w) uint8 grey -> (n, 3, h, w) float tensor normalised like the image processor."""
    import torch

    x = torch.from_numpy(images_uint8).float().div_(255.0)
    x = (x - mean) / std
    return x.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()




# Readable names of the shapes, for image-caption pairs (tiny CLIP pre-training).
SHAPE_NAMES = {"hbar": "horizontal bar", "vbar": "vertical bar", "diag_up": "rising line", "diag_down": "falling line",
               "ring": "ring", "disk": "disk", "square": "square", "plus": "plus sign", "cross": "cross",
               "arc_top": "arch", "arc_bottom": "bowl", "corner": "corner", "triangle": "triangle",
               "parallel": "pair of lines", "dots": "four dots", "zigzag": "zigzag"}
NUMERAL_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def generate_numerals(n: int, seed: int = 0, canvas: int = 32, low_res: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """``n`` typeset numerals 0-9 (uint8, n x low_res x low_res, white on black) and their values.

    Drawn with Pillow's built-in vector font at a random size, offset, stroke width and rotation, then
    reduced to ``low_res`` (area averaging) like a small scan. Typeset glyphs, not handwriting: a
    backbone that learns them meets the benchmark's handwritten digits as a domain shift, as CLIP
    meets a new data set.
    """
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.RandomState(seed)
    labels = rng.randint(0, 10, size=n)
    fonts = {s: ImageFont.load_default(size=s) for s in range(30, 43)}
    out = np.empty((n, low_res, low_res), dtype=np.uint8)
    for i, lab in enumerate(labels):
        img = Image.new("L", (canvas, canvas), 0)
        draw = ImageDraw.Draw(img)
        font = fonts[int(rng.randint(30, 43))]
        cx, cy = rng.uniform(0.42, 0.58, size=2) * canvas
        draw.text((cx, cy), str(lab), fill=int(rng.randint(190, 256)), font=font, anchor="mm",
                  stroke_width=int(rng.randint(0, 3)), stroke_fill=255)
        img = img.rotate(rng.uniform(-15, 15), resample=Image.BILINEAR)
        arr = np.asarray(img.resize((low_res, low_res), Image.BOX), dtype=np.float32)
        arr += rng.normal(0, 8, size=arr.shape)
        out[i] = np.clip(arr, 0, 255).astype(np.uint8)
    return out, labels.astype(np.int64)
