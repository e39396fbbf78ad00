"""The classic baselines resume exactly: Replay (its buffer), EWC (its Fisher diagonal and anchor) and LwF (its
teacher) each killed by SIGKILL on every rank after optimizer step 3 of task 1 (checkpoint_every 2: the re-run
resumes from step 2) end with the uninterrupted run's accuracy matrix and answers. The resumed and the uninterrupted
runs share one launch (``run_task_sequence.py`` with one ``--config`` per run), after one killed launch per method."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import FAULTY, launch, launch_failure, launch_sequences, mcit_config

from mcit.core.registry import METHODS

LORA = {"name": "lora", "r": 2, "alpha": 4, "train_projector": False}
BASELINES = {"replay": ({"replay": 6}, LORA),
             "ewc": ({}, {"name": "ewc", "r": 2, "alpha": 4, "train_projector": False}),
             "lwf": ({}, {"name": "lwf", "r": 2, "alpha": 4, "train_projector": False})}


def _configs(assets: dict[str, Path], tmp: Path, prefix: str) -> dict[str, Path]:
    out = {}
    for name, (data, method) in BASELINES.items():
        if method["name"] not in METHODS.names():
            continue
        path = mcit_config(assets, tmp, f"{prefix}_{name}", data=data,
                           train={"epochs": 1, "batch_size": 8, "lr": 0.01, "checkpoint_every": 2},
                           eval={"batch_size": 24, "zero_shot": False})
        cfg = yaml.safe_load(path.read_text())
        cfg["method"] = method
        path.write_text(yaml.safe_dump(cfg))
        out[name] = path
    return out


def test_replay_ewc_and_lwf_killed_mid_task_resume_to_the_uninterrupted_matrix(mcit_assets, tmp_path):
    whole = _configs(mcit_assets, tmp_path, "whole")
    killed = _configs(mcit_assets, tmp_path, "killed")
    if len(whole) < len(BASELINES):
        pytest.fail(f"baselines not registered: {sorted(set(BASELINES) - set(whole))}")
    for name, cfg in killed.items():
        r = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2, entry=FAULTY, MCIT_TEST_FAULT="1:3")
        assert r.returncode != 0, name
        run = tmp_path / "runs" / f"killed_{name}"
        state = json.loads((run / "state.json").read_text())
        # a launch that died before the fault (e.g. a stuck loader worker) says why on its stderr
        assert "0/commit" in state["completed"] and "1/train" not in state["completed"], \
            (name, state["completed"], launch_failure(r, [run]))
        assert json.loads((run / "checkpoints/task_1/steps/committed.json").read_text())["global_step"] == 2, name
    both = [*killed.values(), *whole.values()]  # the resumed runs, then the uninterrupted ones: one launch
    res = launch_sequences(both)
    assert res.returncode == 0, launch_failure(res, [tmp_path / "runs" / c.stem for c in both])
    for name in whole:
        a, b = tmp_path / "runs" / f"whole_{name}", tmp_path / "runs" / f"killed_{name}"
        got, want = (json.loads((r / "metrics.json").read_text()) for r in (b, a))
        assert got["acc_matrix"] == want["acc_matrix"] and got["complete"], name
        for task in ("0", "1"):
            assert (a / "eval/answers/after_task_1" / f"{task}.jsonl").read_text() == \
                (b / "eval/answers/after_task_1" / f"{task}.jsonl").read_text(), (name, task)
    replay = json.loads((tmp_path / "runs" / "killed_replay" / "replay.json").read_text())
    assert len(replay["buffers"]["colour"]) == 6
