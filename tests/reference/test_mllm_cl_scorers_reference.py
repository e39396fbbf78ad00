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


MATH = json.loads((Path(__file__).parent / "official" / "mllm_cl_math.json").read_text())
MATH_REF = ("answer", "answer_option", "choices", "question_type", "answer_type")


def test_math_rules_read_the_prediction_as_eval_math_does():
    """MLLM-ACL Math's rule before any judge (post_check with prefetch, 37 cases): what it reads, whether the judge
    is then asked, and the score where no judge is needed; letters, option texts, refusals, integers, floats."""
    from mcit.core import judge as J

    for c in MATH["prefetch"]:
        ref = {k: c[k] for k in MATH_REF}
        got = J.prefetch(c["pred"], ref)
        assert got == c["prefetch"] and type(got) is type(c["prefetch"]), c
        assert (not got) == c["judge_called"], c
        if c["score"] is not None:
            assert float(J.hit(got, ref)) == c["score"], c
    assert sum(c["judge_called"] for c in MATH["prefetch"]) >= 10
    assert sum(c["score"] == 1 for c in MATH["prefetch"]) >= 10


def test_math_judge_prompt_and_replies_score_as_eval_math_does():
    """The judge's prompt is build_mathvista_gpt4_prompt's, character for character; its replies (25 cases: a
    letter, option text, numbers with and without decimals, a list) score as MathVista_acc scores them, through
    score_rows, which asks the judge only for the rows the rule could not read."""
    from mcit.core import judge as J

    assert J.prompt("<model prediction>", {"judge_question": "<question column of MathVista_MINI row>"}) == \
        MATH["prompt_template"]
    rows = [{"prediction": c["pred"], "reference": {**{k: c[k] for k in MATH_REF}, "judge_question": f"Q{n}"}}
            for n, c in enumerate(MATH["judge"])]
    asked: list[str] = []

    def judge(prompts: list[str]) -> list[str]:
        asked.extend(prompts)
        by_question = {f"Q{n}\n": c["judge_raw"] for n, c in enumerate(MATH["judge"])}
        return [next(v for q, v in by_question.items() if f"\n{q}Model respone: " in p) for p in prompts]

    scored = J.score_rows("mllm_cl_math", rows, judge)
    assert len(asked) == len(rows)  # none of these predictions is read by the rule
    assert [s["score"] for s in scored] == [c["score"] for c in MATH["judge"]]
    assert all(s["judge_log"] == "Succeed" and s["judge_response"] == c["judge_raw"]
               for s, c in zip(scored, MATH["judge"]))
    ones = sum(c["score"] for c in MATH["judge"])
    assert 5 <= ones <= len(MATH["judge"]) - 5
