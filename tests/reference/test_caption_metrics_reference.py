"""UCIT's captioning score against MCITlib's own evaluation (official/ucit_caption.json: Ghy0501/MCITlib
2956dfd LoRA-FT/llava/eval/CoIN/eval_caption.py, create_coco_type + eval_single over pycocoevalcap 1.2's
COCOEvalCap, run outside the repository on three corpora of 32, 10 and 4 (prediction, references) pairs:
references themselves, case and punctuation changes, unrelated and truncated captions, extra words).
Every metric, and MCITlib's "Average", must be the same; the corpus scorer runs inside the pipeline's
evaluation exactly as here (mcit.run.evaluation.evaluate_row -> mcit.run.cells.score_rows ->
caption_metrics.score_rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcit.core import caption_metrics as C

REF = json.loads((Path(__file__).parent / "official" / "ucit_caption.json").read_text())


@pytest.mark.parametrize("k", range(len(REF["corpora"])))
def test_ucit_caption_equals_mcitlibs_eval_caption(k):
    corpus = REF["corpora"][k]
    rows = [{"prediction": p, "answers": r} for p, r in zip(corpus["predictions"], corpus["references"])]
    value, table = C.score_rows("ucit_caption", rows)
    want = corpus["metrics_x100"]
    for m in C.METRICS:
        assert table[m] * 100 == pytest.approx(want[m], rel=1e-12, abs=1e-9), m
        assert round(table[m] * 100, 2) == corpus["printed"][m]  # the number eval_single prints
    assert value * 100 == pytest.approx(want["Average"], rel=1e-12)
    assert round(value * 100, 2) == corpus["printed"]["Average"]
    assert sum(len(c["predictions"]) for c in REF["corpora"]) >= 30


def test_single_metric_scorers_are_those_metrics():
    corpus = REF["corpora"][0]
    rows = [{"prediction": p, "answers": r} for p, r in zip(corpus["predictions"], corpus["references"])]
    for name, metric in (("caption_cider", "CIDEr"), ("caption_bleu4", "Bleu_4"), ("caption_rouge_l", "ROUGE_L")):
        value, _ = C.score_rows(name, rows)
        assert value * 100 == pytest.approx(corpus["metrics_x100"][metric], rel=1e-12)
