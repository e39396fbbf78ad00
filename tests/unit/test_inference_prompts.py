"""Every shipped benchmark task's test question as its official evaluation script asks it: one row per task, with
the script and lines the rule comes from (read at the commits named in data_prep/inference_prompts.py)."""

from __future__ import annotations

import re

import pytest

from data_prep import inference_prompts as P
from data_prep.instruction_sets import COIN, MLLM_ACL, MLLM_DCL, UCIT

SHIPPED = [("coin", p.name) for p in COIN] + [("ucit", p.name) for p in UCIT] + \
    [("mllm_dcl", p.name) for p in MLLM_DCL] + [("mllm_acl", p.name) for p in MLLM_ACL]
Q = "<image>\nWhat is shown?"
# (benchmark, task): (the question in the test file, its answer, what the official script hands the chat template)
ROWS = {
    ("coin", "scienceqa"): ("Context: a map.\n<image>\nWhich is north?", "A",
                            "<image>\nContext: a map.\n\nWhich is north?"),
    ("coin", "textvqa"): (Q, "x", Q), ("coin", "imagenet"): (Q, "x", Q), ("coin", "gqa"): (Q, "x", Q),
    ("coin", "vizwiz"): (Q, "x", Q), ("coin", "grounding"): (Q, "x", Q), ("coin", "vqav2"): (Q, "x", Q),
    ("coin", "ocrvqa"): (Q, "x", Q),
    ("ucit", "imagenet_r"): (Q, "x", Q), ("ucit", "arxivqa"): (Q, "x", Q), ("ucit", "vizwiz_caption"): (Q, "x", Q),
    ("ucit", "iconqa"): (Q, "x", Q), ("ucit", "clevr_math"): (Q, "x", Q), ("ucit", "flickr30k"): (Q, "x", Q),
    ("mllm_dcl", "rs"): (Q, "yes", Q), ("mllm_dcl", "ad"): (Q, "x", Q), ("mllm_dcl", "sci"): (Q, "A", Q),
    ("mllm_dcl", "med"): (Q, "liver", Q + " Answer the question with a single word (or phrase)."),
    ("mllm_dcl", "fin"): (Q, "Yes", Q + " Only answer with yes or no directly."),
    ("mllm_acl", "ocr"): (Q, "STOP", "<image> What is shown?"),
    ("mllm_acl", "math"): (Q, "5", Q), ("mllm_acl", "vp"): (Q, "2", Q),
}


def test_the_table_names_every_shipped_task_and_nothing_else():
    assert sorted(P.OFFICIAL) == sorted(SHIPPED) == sorted(ROWS)
    assert len(SHIPPED) == 22


@pytest.mark.parametrize("key", SHIPPED, ids=[f"{b}/{t}" for b, t in SHIPPED])
def test_each_task_asks_its_question_as_the_official_script(key):
    question, answer, expected = ROWS[key]
    rule = P.official(*key)
    assert rule.apply(question, answer) == expected
    assert re.search(r"\b\w+/[\w-]+ [0-9a-f]{7} \S+\.py L\d+", rule.source), rule.source  # repo, commit, file, line
    assert rule.record()["source"] == rule.source


def test_fin_picks_its_instruction_by_the_exact_answer():
    """model_fin.py: ``if answer in ['Yes', 'No']`` -- case-sensitive and exact; anything else gets the letter one."""
    fin = P.official("mllm_dcl", "fin")
    letter = " Answer with the given letter directly, e.g., A, B, C, D."
    assert [fin.apply("Up?", a) for a in ("Yes", "No", "yes", "Yes.", "B")] == [
        "Up? Only answer with yes or no directly.", "Up? Only answer with yes or no directly.", "Up?" + letter,
        "Up?" + letter, "Up?" + letter]


def test_a_task_missing_from_the_table_is_named():
    with pytest.raises(KeyError, match="no official inference prompt recorded for coin task 'nocaps'"):
        P.official("coin", "nocaps")
