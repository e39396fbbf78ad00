"""CoIN's and MCITlib's scorers against their own evaluation scripts (official/coin_scorers.json: zackschen/CoIN
4122465; official/ucit_scorers.json: Ghy0501/MCITlib 2956dfd; each case run through the script's own function
outside the repository, see each file's "source"). Every case must score exactly as there; where a scorer departs
from a script's bug by default, the `_official` variant is compared and the departure's cases are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcit.core import scorers

CASES = {**json.loads((Path(__file__).parent / "official" / "coin_scorers.json").read_text())["cases"],
         **json.loads((Path(__file__).parent / "official" / "ucit_scorers.json").read_text())["cases"]}


def _ref(case: dict) -> dict:
    return {k: v for k, v in case.items() if k not in ("pred", "score")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scorer_equals_the_coin_script_on_every_case(name):
    assert len(CASES[name]) >= 30
    got = [scorers.get(name)(c["pred"], _ref(c)) for c in CASES[name]]
    bad = [(c["pred"], _ref(c), c["score"], g) for c, g in zip(CASES[name], got) if abs(g - c["score"]) > 1e-12]
    assert not bad, f"{name}: {len(bad)} cases differ from CoIN's script (pred, ref, CoIN, ours): {bad[:5]}"


def test_imagenet_default_differs_from_the_script_only_on_an_empty_prediction():
    cases = CASES["coin_imagenet_official"]
    diff = [c["pred"] for c in cases if scorers.get("coin_imagenet")(c["pred"], _ref(c)) != c["score"]]
    assert diff == [""]


def test_grounding_default_differs_from_the_script_only_where_its_cut_changes_the_box():
    """eval_grounding.py cuts the first and last character after removing the brackets: a perfect
    "[0.1, 0.2, 0.5, 0.6]" becomes y2 = 0.0 and scores 0 there, 1 here."""
    differ = []
    for c in CASES["coin_grounding_official"]:
        ours = scorers.get("coin_grounding")(c["pred"], _ref(c))
        if ours != c["score"]:
            assert scorers.coin_box(c["pred"]) != scorers.coin_box(c["pred"], official=True), c
            differ.append((c["pred"], ours))
    assert ("[0.1, 0.2, 0.5, 0.6]", 1.0) in differ and ("[0.1, 0.1, 0.5, 0.5].", 1.0) not in differ
    assert 0 < len(differ) < len(CASES["coin_grounding_official"])
