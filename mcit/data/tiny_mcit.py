"""The embedded multimodal continual-instruction benchmark (procedural images, no download).

Every image is 32x32 RGB, drawn with PIL from a seed, or a real 8x8 handwritten digit from
scikit-learn (upscaled and tinted). Two families of data come out of here:

* the **base mix** the project instruction-tunes its tiny LLaVA on (its "pre-training"): captions of
  the whole scene ("a red circle on the left", "three blue squares", "the digit seven") and one
  instruction per skill in its own phrasing (``BASE_QUESTIONS``), so the pre-trained model *has*
  the skills (colours, counts, positions, digits), as a real MLLM has far more than its tasks;
* the **continual tasks**, each a new instruction whose one-word answer needs the image: ``colour``,
  ``count``, ``position``, ``digit``. The model never saw these instructions, so zero-shot it mostly
  answers the wrong thing (a shape, a caption), and each task must be learned; what a method can
  reuse from pre-training is what forward transfer measures.

Records are LLaVA-style conversations (``{"conversations": [{"from": "human", "value": "<image>\\n..."},
{"from": "gpt", "value": ...}]}``), the format of CoIN and UCIT, so the same shard writer serves both.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 190, 40), "blue": (40, 70, 230), "yellow": (235, 220, 40),
    "purple": (150, 40, 200), "orange": (250, 140, 20),
}
SHAPES = ["circle", "square", "triangle", "cross"]
POSITIONS = ["left", "right", "top", "bottom"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SIZE = 32

# The base mix teaches every skill under its own phrasings (one-word answers) and captions of every scene family, so
# the pre-trained model *has* the skills (colours, counts, positions, digits), as a real MLLM has far more than its
# tasks. The continual tasks ask for the same skills with instructions the model has never seen (as CoIN's tasks
# reuse an MLLM's skills with new instructions and answer conventions), each in many phrasings.
BASE_QUESTIONS = {"caption": "Describe the image."}
SKILL_QUESTIONS: dict[str, list[str]] = {
    "shape": ["What shape is this?", "Name the shape.", "Which shape is it?"],
    "colour": ["Name the colour of the object.", "Which colour is the object?", "Say the object's colour."],
    "count": ["Count the objects.", "Give the number of objects.", "Say how many objects."],
    "position": ["On which side is the object?", "Which side is the object on?", "Say the object's side."],
    "digit": ["Read the number.", "Which number is it?", "Say the number."],
}
PARAPHRASES: dict[str, list[str]] = {
    "colour": ["What colour is the figure?", "What is the colour of the figure?", "Which colour does the figure have?",
               "Name the colour of the figure.", "Tell me the colour of the figures.",
               "What colour are the figures painted?"],
    "count": ["How many figures are there?", "How many figures can you see?", "Count the figures.",
              "What is the number of figures?", "Tell me how many figures there are.",
              "How many figures are in the picture?"],
    "position": ["Where is the figure?", "On which side is the figure?", "Where is the figure placed?",
                 "Which side of the image is the figure on?", "Tell me where the figure is.",
                 "In which part of the picture is the figure?"],
    "digit": ["Which digit is written here?", "What digit is this?", "Read the digit.", "Which digit do you see?",
              "Tell me the written digit.", "What digit does the image show?"],
}
# Neutral words around an instruction (base skills and continual tasks alike): a continual task's instruction is
# one of 5 x 6 x 4 = 120 variants, so what a later task's training does to an old task is an average over many
# phrasings, not the flip of one.
PREFIXES = ["", "Look at the image.", "Here is a picture.", "Question:", "See the picture."]
SUFFIXES = ["", "Thanks.", "Please.", "Look closely."]


def phrase(core: str, rng: np.random.RandomState) -> str:
    """``core`` between a prefix and a suffix drawn from ``rng`` (either may be empty)."""
    parts = [PREFIXES[rng.randint(len(PREFIXES))], core, SUFFIXES[rng.randint(len(SUFFIXES))]]
    return " ".join(p for p in parts if p)


def task_question(task: str, rng: np.random.RandomState) -> str:
    """One variant of a continual task's instruction."""
    return phrase(PARAPHRASES[task][rng.randint(len(PARAPHRASES[task]))], rng)


QUESTIONS = {"caption": BASE_QUESTIONS["caption"], **{t: p[0] for t, p in PARAPHRASES.items()}}
CONTINUAL_TASKS = ["colour", "count", "position", "digit"]
TEMPLATE_WORDS = "USER : ASSISTANT"  # the chat template's own words (the tokenizer must know them)


@dataclass
class Scene:
    image: Any  # PIL.Image
    colour: str
    shape: str
    count: int
    position: str | None  # for single-object scenes
    digit: int | None = None


def _draw_shape(draw: Any, shape: str, cx: float, cy: float, r: float, fill: tuple[int, int, int]) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:  # cross
        w = max(1.5, r / 2.5)
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)


def _canvas(rng: np.random.RandomState) -> tuple[Any, Any]:
    from PIL import Image, ImageDraw

    bg = tuple(int(v) for v in rng.randint(0, 40, size=3))
    img = Image.new("RGB", (SIZE, SIZE), bg)
    return img, ImageDraw.Draw(img)


def single_scene(rng: np.random.RandomState) -> Scene:
    """One shape of one colour placed on the left, right, top or bottom of the image."""
    img, draw = _canvas(rng)
    colour = COLOURS_LIST[rng.randint(len(COLOURS_LIST))]
    shape = SHAPES[rng.randint(len(SHAPES))]
    position = POSITIONS[rng.randint(len(POSITIONS))]
    r = rng.uniform(4.0, 6.5)
    jitter = rng.uniform(-3, 3)
    near, far = rng.uniform(6.5, 9.0), SIZE / 2 + jitter
    cx, cy = {"left": (near, far), "right": (SIZE - near, far), "top": (far, near),
              "bottom": (far, SIZE - near)}[position]
    _draw_shape(draw, shape, cx, cy, r, COLOURS[colour])
    return Scene(img, colour, shape, 1, position)


def multi_scene(rng: np.random.RandomState, count: int | None = None) -> Scene:
    """1-4 small shapes of one shape and colour, on a 3x3 grid of cells (no overlaps)."""
    img, draw = _canvas(rng)
    colour = COLOURS_LIST[rng.randint(len(COLOURS_LIST))]
    shape = SHAPES[rng.randint(len(SHAPES))]
    n = int(count if count is not None else rng.randint(1, 5))
    cells = rng.permutation(9)[:n]
    for c in cells:
        cx = 5.5 + (c % 3) * 10.5 + rng.uniform(-1, 1)
        cy = 5.5 + (c // 3) * 10.5 + rng.uniform(-1, 1)
        _draw_shape(draw, shape, cx, cy, rng.uniform(2.8, 3.8), COLOURS[colour])
    return Scene(img, colour, shape, n, None)


COLOURS_LIST = list(COLOURS)


def digit_scene(rng: np.random.RandomState, digit_image: np.ndarray, digit: int) -> Scene:
    """A real 8x8 scikit-learn digit, upscaled to 32x32 and tinted with a random colour."""
    from PIL import Image

    colour = COLOURS_LIST[rng.randint(len(COLOURS_LIST))]
    a = np.clip(digit_image / 16.0, 0, 1)
    a = np.kron(a, np.ones((4, 4)))  # 8x8 -> 32x32
    rgb = (a[..., None] * np.array(COLOURS[colour])[None, None, :]).astype(np.uint8)
    return Scene(Image.fromarray(rgb, mode="RGB"), colour, "digit", 1, None, digit)


def caption(scene: Scene) -> str:
    if scene.digit is not None:
        return f"the digit {NUMBERS[scene.digit]}"
    if scene.position is not None:
        return f"a {scene.colour} {scene.shape} on the {scene.position}"
    noun = scene.shape + ("es" if scene.shape == "cross" else "s") if scene.count > 1 else scene.shape
    return f"{NUMBERS[scene.count]} {scene.colour} {noun}"


def png_bytes(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def record(key: str, scene: Scene, question: str, answer: str) -> dict[str, Any]:
    """One LLaVA-style conversation sample (the shard writer's input)."""
    return {"__key__": key, "png": png_bytes(scene.image),
            "conversations": [{"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}],
            "answers": [answer]}


def _digits(train: bool, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    xtr, xte, ytr, yte = train_test_split(d.images, d.target, test_size=0.25, random_state=seed, stratify=d.target)
    return (xtr, ytr) if train else (xte, yte)


def task_samples(task: str, n: int, seed: int, *, train: bool) -> list[dict[str, Any]]:
    """``n`` samples of one task. Train and test draw from disjoint seeds (and disjoint real digits)."""
    rng = np.random.RandomState(seed * 7919 + (0 if train else 1) + 17 * (list(QUESTIONS).index(task) + 1))
    prefix = f"{task}_{'train' if train else 'test'}"
    out: list[dict[str, Any]] = []
    if task == "digit":
        xs, ys = _digits(train, seed)
        order = rng.permutation(len(xs))
        for i in range(n):
            j = order[i % len(xs)]
            s = digit_scene(rng, xs[j], int(ys[j]))
            out.append(record(f"{prefix}_{i:06d}", s, task_question("digit", rng), NUMBERS[s.digit]))
        return out
    for i in range(n):
        s, ans = skill_scene(task, rng)
        out.append(record(f"{prefix}_{i:06d}", s, task_question(task, rng), ans))
    return out


def skill_scene(skill: str, rng: np.random.RandomState, digit: Callable[[], Scene] | None = None) -> tuple[Scene, str]:
    """A scene for one skill and its one-word answer."""
    if skill in ("colour", "shape"):
        s = single_scene(rng) if rng.rand() < 0.5 else multi_scene(rng)
        return s, s.colour if skill == "colour" else s.shape
    if skill == "count":
        s = multi_scene(rng)
        return s, NUMBERS[s.count]
    if skill == "position":
        s = single_scene(rng)
        return s, s.position
    if skill == "digit" and digit is not None:
        s = digit()
        return s, NUMBERS[s.digit]
    raise ValueError(f"unknown task {skill!r}")


def base_mix(n: int, seed: int, *, train: bool = True) -> list[dict[str, Any]]:
    """The pre-training mix: 40% captions of every scene family, 60% the skill questions in their base phrasings
    (between the same prefixes and suffixes as the continual tasks' instructions)."""
    rng = np.random.RandomState(seed * 104729 + (0 if train else 1))
    xs, ys = _digits(train, seed)
    out = []

    def digit() -> Scene:
        j = rng.randint(len(xs))
        return digit_scene(rng, xs[j], int(ys[j]))

    for i in range(n):
        u = rng.rand()
        key = f"base_{i:06d}"
        if u < 0.4:
            v = rng.rand()
            s = single_scene(rng) if v < 0.35 else multi_scene(rng) if v < 0.7 else digit()
            out.append(record(key, s, BASE_QUESTIONS["caption"], caption(s)))
            continue
        skill = list(SKILL_QUESTIONS)[min(4, int((u - 0.4) / 0.12))]
        s, ans = skill_scene(skill, rng, digit)
        core = SKILL_QUESTIONS[skill][rng.randint(len(SKILL_QUESTIONS[skill]))]
        out.append(record(key, s, phrase(core, rng), ans))
    return out


def corpus() -> list[str]:
    """Every word the benchmark can ask or answer (the tiny tokenizer is trained on this)."""
    words = [TEMPLATE_WORDS, "a the on digit", *BASE_QUESTIONS.values(), *(q for p in PARAPHRASES.values() for q in p),
             *(q for p in SKILL_QUESTIONS.values() for q in p), *PREFIXES, *SUFFIXES,
             *COLOURS, *POSITIONS, *NUMBERS]
    for sh in SHAPES:
        words += [sh, sh + ("es" if sh == "cross" else "s")]
    return words


def attribute_scenes(n: int, seed: int) -> tuple[list[Any], dict[str, list[int]]]:
    """``n`` random scenes of every family with all their attributes as class indices (-100 where an
    attribute does not apply): the supervision of the tiny vision tower's pre-training."""
    rng = np.random.RandomState(seed * 7 + 12345)
    xs, ys = _digits(True, seed)
    images: list[Any] = []
    labels: dict[str, list[int]] = {k: [] for k in ("colour", "shape", "count", "position", "digit")}
    for _ in range(n):
        v = rng.rand()
        if v < 0.35:
            s = single_scene(rng)
        elif v < 0.7:
            s = multi_scene(rng)
        else:
            j = rng.randint(len(xs))
            s = digit_scene(rng, xs[j], int(ys[j]))
        images.append(s.image)
        labels["colour"].append(COLOURS_LIST.index(s.colour))
        labels["shape"].append(SHAPES.index(s.shape) if s.shape in SHAPES else -100)
        labels["count"].append(s.count - 1 if s.digit is None else -100)
        labels["position"].append(POSITIONS.index(s.position) if s.position else -100)
        labels["digit"].append(s.digit if s.digit is not None else -100)
    return images, labels
