"""Per-task scorers of generated answers: each maps (prediction, reference meta) to a score in [0, 1].

The normalisation follows the VQA evaluation script's spirit (lower case, punctuation and articles
removed, number words to digits), so "Three." and "3" match.
"""

from __future__ import annotations

import re
from typing import Any, Callable

Scorer = Callable[[str, dict[str, Any]], float]
SCORERS: dict[str, Scorer] = {}

_NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
            "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_ARTICLES = {"a", "an", "the"}
_PUNCT = re.compile(r"[;/\[\]\"{}()=+\\_\-><@`,?!*#%^&$~|:]")


def normalize(text: str) -> str:
    t = text.lower().replace("\n", " ").strip()
    t = _PUNCT.sub(" ", t)
    t = re.sub(r"(?<!\d)\.(?!\d)", " ", t)  # full stops, not decimal points
    words = [_NUMBERS.get(w, w) for w in t.split() if w not in _ARTICLES]
    return " ".join(words)


def register(name: str) -> Callable[[Scorer], Scorer]:
    def deco(fn: Scorer) -> Scorer:
        SCORERS[name] = fn
        return fn

    return deco


def get(name: str) -> Scorer:
    if name not in SCORERS:
        raise KeyError(f"unknown scorer {name!r}; known: {', '.join(sorted(SCORERS))}")
    return SCORERS[name]


@register("exact_match")
def exact_match(pred: str, ref: dict[str, Any]) -> float:
    """1 if the normalised prediction equals the normalised answer (or any reference answer)."""
    p = normalize(pred)
    return float(any(p == normalize(a) for a in ref.get("answers") or [ref["answer"]]))


@register("vqa_accuracy")
def vqa_accuracy(pred: str, ref: dict[str, Any]) -> float:
    """VQA accuracy: min(#annotators who gave this answer / 3, 1), averaged over the 10 leave-one-out
    subsets of annotators as the official script does (equal to min(n/3, 1) up to that averaging)."""
    answers = [normalize(a) for a in ref.get("answers") or [ref["answer"]]]
    p = normalize(pred)
    if len(answers) <= 1:
        return float(bool(answers) and p == answers[0])
    accs = []
    for i in range(len(answers)):
        others = answers[:i] + answers[i + 1:]
        accs.append(min(sum(a == p for a in others) / 3.0, 1.0))
    return sum(accs) / len(accs)


@register("multiple_choice")
def multiple_choice(pred: str, ref: dict[str, Any]) -> float:
    """The first option letter of the prediction ("B", "(B)", "B. text", "Answer: B") equals the answer's."""

    def letter(text: str) -> str | None:
        t = text.strip()
        m = re.match(r"^(?:answer\s*[:is]*\s*)?\(?([A-Za-z])\)?(?:[.):\s]|$)", t, flags=re.I)
        return m.group(1).upper() if m else None

    return float(letter(pred) is not None and letter(pred) == letter(ref["answer"]))


@register("contains")
def contains(pred: str, ref: dict[str, Any]) -> float:
    """1 if the normalised answer occurs in the normalised prediction as whole words."""
    p = f" {normalize(pred)} "
    return float(any(f" {normalize(a)} " in p for a in ref.get("answers") or [ref["answer"]] if normalize(a)))


def parse_box(text: str) -> list[float] | None:
    nums = re.findall(r"-?\d+(?:\.\d+)?", text)
    if len(nums) < 4:
        return None
    return [float(x) for x in nums[:4]]


def box_iou(a: list[float], b: list[float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    area = lambda r: max(0.0, r[2] - r[0]) * max(0.0, r[3] - r[1])  # noqa: E731
    union = area(a) + area(b) - inter
    return inter / union if union > 0 else 0.0


@register("grounding_iou")
def grounding_iou(pred: str, ref: dict[str, Any]) -> float:
    """1 if the predicted box [x0, y0, x1, y1] has IoU >= 0.5 with the reference box."""
    box = parse_box(pred)
    target = ref.get("box") or parse_box(ref["answer"])
    if box is None or target is None:
        return 0.0
    return float(box_iou(box, [float(v) for v in target]) >= 0.5)
