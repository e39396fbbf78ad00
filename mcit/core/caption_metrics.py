"""Corpus-level caption metrics (UCIT's VizWiz-caption and Flickr30k), from pycocoevalcap.

MCITlib scores a captioning task with its ``eval_caption.py``: the predictions and the references go
through pycocoevalcap's ``COCOEvalCap`` (Stanford PTB tokenisation, lower case, punctuation removed), and
the task's number is the mean of BLEU-1..4, METEOR, ROUGE-L and CIDEr, each x 100 (its "Average").
These are corpus metrics (CIDEr's idf and BLEU's brevity penalty are over the whole test set), so they
are computed once per task over every rank's gathered answers, never averaged from per-sample scores.

The PTB tokeniser and METEOR are Java programs shipped inside pycocoevalcap; a machine without ``java``
gets a one-line error naming the scorer before any training (``check``). SPICE, which COCOEvalCap also
runs, is left out: MCITlib does not report it, and it downloads Stanford models at run time.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from typing import Any, Callable

METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr")
CorpusScorer = Callable[[list[str], list[list[str]]], tuple[float, dict[str, float]]]
CORPUS: dict[str, tuple[CorpusScorer, tuple[str, ...]]] = {}


def check() -> str | None:
    """Why the caption metrics cannot run here (pycocoevalcap or java missing), or None."""
    try:
        import pycocoevalcap  # noqa: F401
    except ImportError:
        return "pycocoevalcap is not installed (pip install pycocoevalcap)"
    if shutil.which("java") is None:
        return "java is not on PATH (pycocoevalcap's PTB tokeniser and METEOR are Java programs)"
    return None


def coco_scores(preds: list[str], refs: list[list[str]], metrics: tuple[str, ...] = METRICS) -> dict[str, float]:
    """COCOEvalCap's numbers (fractions, not x 100) of ``metrics`` for predictions and their references,
    one image per prediction, tokenised as COCOEvalCap does."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    if not preds:
        return {m: 0.0 for m in metrics}
    tok = PTBTokenizer()
    gts = tok.tokenize({i: [{"caption": r} for r in rs] for i, rs in enumerate(refs)})
    res = tok.tokenize({i: [{"caption": p}] for i, p in enumerate(preds)})
    out: dict[str, float] = {}
    if any(m.startswith("Bleu") for m in metrics):
        with contextlib.redirect_stdout(io.StringIO()):  # Bleu prints its n-gram counts
            score, _ = Bleu(4).compute_score(gts, res)
        out.update({f"Bleu_{n + 1}": float(s) for n, s in enumerate(score)})
    if "METEOR" in metrics:
        out["METEOR"] = float(Meteor().compute_score(gts, res)[0])
    if "ROUGE_L" in metrics:
        out["ROUGE_L"] = float(Rouge().compute_score(gts, res)[0])
    if "CIDEr" in metrics:
        out["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    return {m: out[m] for m in metrics}


def register(name: str, metrics: tuple[str, ...]) -> Callable[[CorpusScorer], CorpusScorer]:
    def deco(fn: CorpusScorer) -> CorpusScorer:
        CORPUS[name] = (fn, metrics)
        return fn

    return deco


@register("ucit_caption", METRICS)
def ucit_caption(preds: list[str], refs: list[list[str]]) -> tuple[float, dict[str, float]]:
    """MCITlib's eval_caption.py "Average": the mean of the seven metrics (as a fraction: x 100 is the
    number MCITlib prints)."""
    s = coco_scores(preds, refs, METRICS)
    return sum(s.values()) / len(s), s


@register("caption_cider", ("CIDEr",))
def caption_cider(preds: list[str], refs: list[list[str]]) -> tuple[float, dict[str, float]]:
    """CIDEr (COCOEvalCap's, PTB-tokenised); it ranges over [0, 10], so x 100 may pass 100."""
    s = coco_scores(preds, refs, ("CIDEr",))
    return s["CIDEr"], s


@register("caption_bleu4", ("Bleu_4",))
def caption_bleu4(preds: list[str], refs: list[list[str]]) -> tuple[float, dict[str, float]]:
    s = coco_scores(preds, refs, ("Bleu_4",))
    return s["Bleu_4"], s


@register("caption_rouge_l", ("ROUGE_L",))
def caption_rouge_l(preds: list[str], refs: list[list[str]]) -> tuple[float, dict[str, float]]:
    s = coco_scores(preds, refs, ("ROUGE_L",))
    return s["ROUGE_L"], s


def score_rows(name: str, rows: list[dict[str, Any]]) -> tuple[float, dict[str, float]]:
    """The corpus scorer ``name`` over answer rows (``prediction``, ``answers``)."""
    return CORPUS[name][0]([r["prediction"] for r in rows], [list(r["answers"]) for r in rows])
