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
"""

from __future__ import annotations

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
