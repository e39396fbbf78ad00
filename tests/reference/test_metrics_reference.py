"""The continual metrics against mammoth's own functions on one fixed accuracy matrix.

Reference numbers: aimagelab/mammoth e75a491c69fd729edeb01431afb753d9157d9a81, ``utils/metrics.py``
(``forgetting``, ``backward_transfer``, ``forward_transfer``), run unchanged in a scratch folder on the
rows below (mammoth logs row t as the accuracies on tasks 0..t; ``forward_transfer`` reads the full
matrix and a per-task baseline, our zero-shot row):

    forgetting(ROWS) = 20.416666666666668
    backward_transfer(ROWS) = -19.666666666666668
    forward_transfer(FULL, [[10.0], [12.5], [8.0], [11.0]]) = -7.333333333333333

The last task improves task 2 (79.0 -> 81.25): Chaudhry's forgetting counts it as -2.25, mammoth's
maximum over every row (the last included) as 0, hence the two numbers.

MCITlib's columns (MFT, MFN, MAA, BWT) against official/mcitlib_metrics.json (its source says where they came from).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcit.core import metrics as M

FULL = [[91.5, 3.0, 1.0, 0.0], [62.0, 88.25, 2.5, 0.5], [70.5, 55.0, 79.0, 4.0], [58.0, 60.5, 81.25, 84.0]]
ZERO_SHOT = [10.0, 12.5, 8.0, 11.0]
MAMMOTH = {"forgetting": 20.416666666666668, "backward_transfer": -19.666666666666668,
           "forward_transfer": -7.333333333333333}


def test_metrics_match_mammoth_and_chaudhry():
    m = M.compute(FULL, [100, 100, 100, 100], ZERO_SHOT)
    assert m["forgetting_mammoth"] == pytest.approx(MAMMOTH["forgetting"], abs=1e-5)
    assert m["bwt"] == pytest.approx(MAMMOTH["backward_transfer"], abs=1e-5)
    assert m["fwd"] == pytest.approx(MAMMOTH["forward_transfer"], abs=1e-5)
    # Chaudhry et al.: the maximum over the rows before the last, so an improved task counts negative
    assert m["forgetting"] == pytest.approx(((91.5 - 58.0) + (88.25 - 60.5) + (79.0 - 81.25)) / 3, abs=1e-9)
    assert m["forgetting"] < m["forgetting_mammoth"]


MCITLIB = json.loads((Path(__file__).parent / "official" / "mcitlib_metrics.json").read_text())


@pytest.mark.parametrize("case", MCITLIB["cases"], ids=lambda c: c["name"])
def test_mcitlib_columns_equal_its_numbers(case):
    """MFT, MFN, MAA and BWT against the numbers in official/mcitlib_metrics.json (MCITlib's definitions; its
    repository has no code for them, see the file's source) on tables from T = 1 to 6, with an old task that
    improves, zeros, a non-monotone row, and an upper triangle of tasks not yet trained that must be ignored.
    Unequal sample counts: the columns are task means, never sample-weighted."""
    acc = case["acc"]
    T = len(acc)
    m = M.compute(acc, [7 + 13 * i for i in range(T)])
    for ours, theirs in (("mft", "MFT"), ("mfn", "MFN"), ("maa", "MAA"), ("bwt", "BWT")):
        if case[theirs] is None:  # BWT of one task: MCITlib has none, we report 0
            assert T == 1 and m[ours] == 0.0
            continue
        assert m[ours] == pytest.approx(case[theirs], rel=1e-12, abs=1e-9 * max(1.0, abs(case[theirs]))), ours


def test_mcitlib_table_is_not_trivial():
    """The cases tell the columns apart: MFT differs from MFN and MAA on most tables, BWT takes both signs, and
    one table's upper triangle is filled (the same numbers as with it zeroed)."""
    cases = MCITLIB["cases"]
    assert len({len(c["acc"]) for c in cases}) >= 5
    assert sum(abs(c["MFT"] - c["MFN"]) > 1 and abs(c["MFT"] - c["MAA"]) > 1 for c in cases) >= 5
    bwts = [c["BWT"] for c in cases if c["BWT"] is not None]
    assert min(bwts) < -1 and max(bwts) > 1
    assert any(any(v != 0 for t, row in enumerate(c["acc"]) for v in row[t + 1:]) for c in cases)
