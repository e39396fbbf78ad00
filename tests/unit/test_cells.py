"""Evaluation cells (mcit.run.cells): answers computed once, committed in chunks, reused by key; an evaluation
interrupted in the middle of a split goes on from its committed chunks to the uninterrupted row."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_config

from mcit.run import cells as CS

pytestmark = pytest.mark.unit


class Interrupted(RuntimeError):
    pass


@pytest.fixture(scope="module")
def host(assets, tmp_path_factory):
    """The tiny ViT with L2P, built as the pipeline builds it (one process), on a 3-task digits sequence."""
    from mcit.core import distributed as dist
    from mcit.core.config import load_config
    from mcit.run.lifecycle import MethodHost
    from mcit.run.preflight import preflight

    tmp = tmp_path_factory.mktemp("cells")
    dist.init()
    plan = preflight(load_config(tiny_config(assets, tmp, "cells", eval={"batch_size": 10, "chunk_size": 7})))
    h = MethodHost(plan)
    h.build()
    return h


def _row(host, tmp, name, trained=0, **eval_cfg):
    from mcit.run.evaluation import evaluate_row

    for k, v in {"cells": str(tmp / f"cells_{name}"), "reuse": True, "chunk_size": 7, "batch_size": 10,
                 **eval_cfg}.items():
        setattr(host.cfg.eval, k, v)
    with host.zero_shot():
        return evaluate_row(host, trained=trained, answers_dir=tmp / f"answers_{name}")


def test_an_interrupted_row_goes_on_from_its_committed_chunks(host, tmp_path):
    """An evaluation stopped after 2 chunks (7 samples each) of task 1 keeps task 0's answers and those 14: the next
    pass answers only the rest, and the row and answer files equal an uninterrupted pass's; a third pass answers
    nothing. The chunks are gone once the cells are complete."""
    ref = _row(host, tmp_path, "ref")
    counts = ref["total"]
    assert [c["computed"] for c in ref["cells"]] == counts and len(counts) == 3 and min(counts) > 14

    armed = [True]

    @CS.on_chunk
    def stop(cell, writer, seq):
        if armed and cell.key["task"] == 1 and seq == 1:
            raise Interrupted

    try:
        with pytest.raises(Interrupted):
            _row(host, tmp_path, "cut")
    finally:
        armed.clear()  # the seam has no removal: the hook stays, disarmed
    chunks = sorted((tmp_path / "cells_cut").rglob("chunks/*.jsonl"))
    held = sum(len(f.read_text().splitlines()) for f in chunks)
    assert held == counts[0] + 14
    again = _row(host, tmp_path, "cut")
    assert [(c["reused"], c["computed"]) for c in again["cells"]] == [(counts[0], 0), (14, counts[1] - 14),
                                                                     (0, counts[2])]
    assert again["acc"] == ref["acc"] and again["correct"] == ref["correct"]
    for i in range(3):
        assert (tmp_path / "answers_cut" / f"{i}.jsonl").read_text() == \
            (tmp_path / "answers_ref" / f"{i}.jsonl").read_text()
    assert not list((tmp_path / "cells_cut").rglob("chunks"))
    third = _row(host, tmp_path, "cut")
    assert [(c["reused"], c["computed"]) for c in third["cells"]] == [(n, 0) for n in counts]
    assert third["acc"] == ref["acc"]
    rows = [json.loads(x) for x in (tmp_path / "answers_ref" / "1.jsonl").read_text().splitlines()]
    assert len(rows) == counts[1] and {"key", "label", "prediction", "score"} <= set(rows[0])
    assert [r["key"] for r in rows] == sorted(r["key"] for r in rows)
    assert 100 * sum(r["prediction"] == r["label"] for r in rows) / len(rows) == pytest.approx(ref["acc"][1])


def test_a_changed_key_is_a_new_cell_and_what_does_not_decide_answers_is_not_in_it(host, tmp_path):
    """After another class mask (another row), another method state or another generation setting, the cell is
    computed again; another batch size or chunk size reuses it. ``eval.reuse: false`` answers again and leaves the
    complete cell as it was."""
    base = _row(host, tmp_path, "k")
    digests = [c["digest"] for c in base["cells"]]
    same = _row(host, tmp_path, "k", batch_size=3, chunk_size=2)
    assert [c["digest"] for c in same["cells"]] == digests and all(c["computed"] == 0 for c in same["cells"])
    masked = _row(host, tmp_path, "k", trained=1)  # after task 0: only its classes may be predicted
    assert all(c["digest"] not in digests and c["reused"] == 0 for c in masked["cells"])
    assert masked["acc"][1] == 0.0 and masked["acc"][2] == 0.0
    try:  # the same row with every class allowed: another mask, another cell
        unmasked = _row(host, tmp_path, "k", trained=1, mask_unseen_classes=False)
    finally:
        host.cfg.eval.mask_unseen_classes = True
    assert [c["digest"] for c in unmasked["cells"]] != [c["digest"] for c in masked["cells"]]
    assert all(c["reused"] == 0 for c in unmasked["cells"]) and unmasked["acc"] == base["acc"]
    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "cells_k").rglob("cell.json")}
    fresh = _row(host, tmp_path, "k", reuse=False, batch_size=7)
    assert fresh["acc"] == base["acc"] and all(c["reused"] == 0 and c["computed"] > 0 for c in fresh["cells"])
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cells_k").rglob("cell.json")} == stamp
    plan = host.plan
    key = CS.cell_key(plan, 0, 0, "a" * 64)
    assert CS.key_digest(key) == CS.key_digest(CS.cell_key(plan, 0, 0, "a" * 64))
    assert CS.key_digest(CS.cell_key(plan, 0, 0, "b" * 64)) != CS.key_digest(key)
    assert CS.key_digest(CS.cell_key(plan, 1, 0, "a" * 64)) != CS.key_digest(key)
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(2, dtype=torch.bfloat16)}
    d = CS.state_digest(state)
    assert d == CS.state_digest({k: v.clone() for k, v in reversed(list(state.items()))})
    moved = dict(state, w=state["w"].clone())
    moved["w"][1, 2] = torch.nextafter(moved["w"][1, 2], torch.tensor(10.0))  # one ulp
    assert CS.state_digest(moved) != d


def test_chunks_commit_every_chunk_size_rows_and_merge_by_key(tmp_path):
    """A writer commits every ``size`` rows and the rest at flush; two writers' chunks (a second run answering the
    same cell) merge by key; finishing removes the chunks, and a finished cell is never rewritten."""
    cell = CS.Cell(tmp_path, {"task": 0, "trained": 0, "x": 1})
    a, b = cell.writer(0, 2), cell.writer(1, 2)
    a.add([{"key": f"k{i}", "prediction": i} for i in range(5)], 2)
    assert len(list(cell.chunks.glob("*.jsonl"))) == 2  # k0-k1, k2-k3; k4 pending
    a.flush()
    b.add([{"key": "k4", "prediction": 4}, {"key": "k5", "prediction": 5}], 2)
    rows = cell.chunk_rows()
    assert sorted(rows) == [f"k{i}" for i in range(6)] and len(list(cell.chunks.glob("*.jsonl"))) == 4
    cell.finish(list(rows.values()), {"scorer": "s", "scorer_version": "v", "score_sum": 0.0, "metrics": None})
    assert cell.complete() and not cell.chunks.exists()
    assert [r["key"] for r in cell.rows()] == [f"k{i}" for i in range(6)]
    before = cell.answers.read_text()
    cell.finish([{"key": "other"}], {"scorer": "s", "scorer_version": "v", "score_sum": 9.0, "metrics": None})
    assert cell.answers.read_text() == before and cell.info()["score_sum"] == 0.0


def test_the_evaluation_bar_counts_the_launch_s_samples_and_never_passes_its_total(monkeypatch):
    """Rank 0's answers stand for every rank's (x world size), capped at the total: the ranks' shares differ by up
    to a batch, and the bar once showed 2560/? for 2400 samples. At the gather it shows the whole pass."""
    import io

    from mcit.core import distributed as dist
    from mcit.core.progress import LineProgress
    from mcit.run import evaluation as E

    monkeypatch.setattr(dist, "world_size", lambda: 2)
    bar = LineProgress(2400, "eval", "sample", file=io.StringIO())
    seen = []
    for _ in range(20):  # rank 0's part: 20 batches of 64 (1280 > 1200, its share)
        E.advance_bar(bar, 64)
        seen.append(bar.n)
    assert seen[-1] == 2400 and max(seen) == 2400 and seen[:2] == [128, 256]
    bar = LineProgress(2400, "eval", "sample", file=io.StringIO())
    E.advance_bar(bar, 1100)
    E.gather_answers([], None, bar)
    assert bar.n == 2400
