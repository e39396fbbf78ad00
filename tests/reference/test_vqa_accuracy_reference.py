"""vqa_accuracy against the official VQA evaluation (official/vqa_accuracy.json: GT-Vision-Lab/VQA a013f00,
vqaEval.py run outside the repository on each case, 12 digits)."""

from __future__ import annotations

import json
from pathlib import Path

from mcit.core import scorers

CASES = json.loads((Path(__file__).parent / "official" / "vqa_accuracy.json").read_text())["cases"]["vqa_accuracy"]


def test_vqa_accuracy_equals_the_official_evaluation_on_every_case():
    assert len(CASES) >= 30
    bad = [(c["pred"], c["answers"], c["score"], g) for c in CASES
           if abs((g := scorers.vqa_accuracy(c["pred"], {"answers": c["answers"]})) - c["score"]) > 1e-9]
    assert not bad, f"{len(bad)} cases differ from vqaEval.py (pred, answers, official, ours): {bad[:5]}"


def test_identical_answers_are_not_normalised():
    """vqaEval.py normalises only when the annotators disagree: ten "yes" do not accept "Yes"."""
    assert scorers.vqa_accuracy("Yes", {"answers": ["yes"] * 10}) == 0.0
    assert scorers.vqa_accuracy("Yes", {"answers": ["yes"] * 9 + ["no"]}) == 1.0
