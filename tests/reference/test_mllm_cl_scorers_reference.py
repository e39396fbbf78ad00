"""MLLM-CL's scorers (MLLM-DCL: RS, AD, Med, Sci, Fin; MLLM-ACL: OCR, VP) against its own evaluation scripts
(official/mllm_cl_scorers.json: bjzhb666/MLLM-CL 80bf389, ETrain/Eval/LLaVA/CoIN/eval_*.py, byte-identical in
Ghy0501/MCITlib 2956dfd; each case run through the unmodified script on a one-record test and answer file outside
the repository, see the file's "source"). Every case must score exactly as there, quirks included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcit.core import scorers

CASES = json.loads((Path(__file__).parent / "official" / "mllm_cl_scorers.json").read_text())["cases"]


def _ref(case: dict) -> dict:
    return {k: v for k, v in case.items() if k not in ("pred", "score", "note")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scorer_equals_mllm_cl_s_script_on_every_case(name):
    cases = CASES[name]
    assert len(cases) >= 60 and 0 < sum(c["score"] for c in cases) < len(cases)  # both outcomes, many times
    got = [scorers.get(name)(c["pred"], _ref(c)) for c in cases]
    bad = [(c["pred"], _ref(c), c["score"], g) for c, g in zip(cases, got) if abs(g - c["score"]) > 1e-12]
    assert not bad, f"{name}: {len(bad)} cases differ from MLLM-CL's script (pred, ref, MLLM-CL, ours): {bad[:5]}"


def test_the_table_holds_the_rules_quirks():
    """The cases that decide between plausible readings are there: eval_ai2d drops a one-word answer's full stops
    (so "3.5" never matches itself), MapQA's list rule gives fractions, OCRBench's formula category keeps case."""
    by = {(c["pred"], c["answer"]): c["score"] for c in CASES["mllm_cl_ai2d"]}
    assert by[("3.5", "3.5")] == 0.0 and by[("35", "3.5")] == 1.0
    assert any(0 < c["score"] < 1 for c in CASES["mllm_cl_sci"])
    hme = [c for c in CASES["mllm_cl_ocrbench"] if c["answer_type"].startswith("Handwritten")]
    assert any(c["score"] == 0 and c["pred"].lower().replace(" ", "") == c["answer"].lower().replace(" ", "")
               for c in hme)
