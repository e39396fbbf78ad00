"""A following evaluation worker's choice of its next row (``mcit.run.deferred.next_row``), from a run directory's
state: the first committed row neither in nor held, a wait while the run's launch lives, the end otherwise."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mcit.core.rundir import RunDir
from mcit.run import deferred as D

pytestmark = pytest.mark.unit


def _plan(root, stages: int = 2):
    run = RunDir(root)
    return SimpleNamespace(run=run, num_stages=stages, cfg=SimpleNamespace(eval=SimpleNamespace(zero_shot=True)))


def _state(plan, completed, finished=False) -> None:
    plan.run.root.mkdir(parents=True, exist_ok=True)
    plan.run.state.write_text(json.dumps({"completed": completed, "finished": finished}))


def _row(plan, k) -> None:
    path = plan.run.row(k)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")


def test_a_following_worker_takes_committed_rows_in_order_waits_for_the_launch_and_ends(tmp_path):
    plan = _plan(tmp_path / "run")
    _state(plan, [])
    assert D.next_row(plan) is None  # nothing committed, no launch: nothing will come
    launch = plan.run.lock
    assert launch.acquire() is None
    try:
        assert D.next_row(plan) == D.WAIT  # the launch lives: a commit may come
        _state(plan, ["zero_shot", "0/train", "0/commit"])
        assert D.next_row(plan) == "zero_shot"
        held = D.worker_lock(plan.run, "zero_shot")
        assert held.acquire() is None  # another worker answers it
        try:
            assert D.next_row(plan) == "after_task_0"
        finally:
            held.release()
        _row(plan, None)
        _row(plan, 0)
        assert D.next_row(plan) == D.WAIT  # task 1 not committed yet
        _state(plan, ["zero_shot", "0/train", "0/commit", "1/train", "1/commit"])
        assert D.next_row(plan) == "after_task_1"
        _row(plan, 1)
        assert D.next_row(plan) is None  # every row in
    finally:
        launch.release()


def test_a_following_worker_finishes_what_a_dead_launch_committed_then_ends(tmp_path):
    plan = _plan(tmp_path / "run")
    _state(plan, ["zero_shot", "0/train", "0/commit"])
    _row(plan, None)
    assert D.next_row(plan) == "after_task_0"  # committed by a launch that is gone
    _row(plan, 0)
    assert D.next_row(plan) is None  # not WAIT: no launch holds run.lock (the next launch starts a worker)
    _state(plan, ["zero_shot", "0/train", "0/commit"], finished=True)
    assert D.next_row(plan) is None
