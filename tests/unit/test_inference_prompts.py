"""Every shipped benchmark task's test question as its official evaluation script asks it: one row per task, with
the script and lines the rule comes from (read at the commits named in data_prep/inference_prompts.py)."""

from __future__ import annotations

import re
from pathlib import Path

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


# every shipped benchmark config, by its name's prefix
BENCHMARK_OF = {"coin": "coin", "ucit": "ucit", "dcl": "mllm_dcl", "acl": "mllm_acl"}
BENCH_CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")
                       if p.name.split("_")[0] in BENCHMARK_OF)


def test_every_task_has_its_official_generation_cap_with_its_source():
    assert sorted(P.MAX_NEW_TOKENS) == sorted(SHIPPED)
    for n, source in [*P.MAX_NEW_TOKENS.values(), *P.METHOD_MAX_NEW_TOKENS.values()]:
        assert n >= 1 and re.search(r"\b\w+/[\w-]+ [0-9a-f]{7} \S+\.py", source), source
    assert P.official_max_new_tokens("ucit", "arxivqa", "lora") == 256
    assert P.official_max_new_tokens("ucit", "arxivqa", "sefe") == 1024
    assert P.official_max_new_tokens("mllm_dcl", "fin", "sefe") == 128  # only UCIT's differ per folder
    with pytest.raises(KeyError, match="no official generation cap recorded for coin task 'nocaps'"):
        P.official_max_new_tokens("coin", "nocaps", "lora")


@pytest.mark.parametrize("config", BENCH_CONFIGS, ids=lambda p: p.stem)
def test_each_shipped_benchmark_config_generates_with_the_official_caps(config):
    """The official scripts' own max_new_tokens take precedence over eval.max_new_tokens: each task of a shipped
    benchmark config carries its official cap (the method's folder's, where MCITlib's differs)."""
    from mcit.core.config import load_config

    cfg = load_config(config)
    bench = BENCHMARK_OF[config.name.split("_")[0]]
    names = [t if isinstance(t, str) else t.name for t in cfg.data.tasks]
    got = {n: cfg.task_max_new_tokens(i) for i, n in enumerate(names)}
    want = {n: P.official_max_new_tokens(bench, n, cfg.method.name) for n in names}
    assert got == want
