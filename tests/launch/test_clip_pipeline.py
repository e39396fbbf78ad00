"""The CLIP methods through the launched pipeline."""

from __future__ import annotations

import json


def test_clip_zero_shot_runs_the_pipeline_without_training(assets, clip_backbone, tmp_path):
    from conftest import launch, tiny_config

    cfg = tiny_config(assets, tmp_path, "zs", backbone={"kind": "clip", "path": str(clip_backbone), "tag": "tiny_clip"},
                      method={"name": "clip_zero_shot", "templates": ["a photo of the digit {}."]},
                      data={"root": str(assets["shards"]), "tasks": ["task0", "task1"]})
    proc = launch(["--config", str(cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "runs" / "zs" / "metrics.json").read_text())
    assert metrics["complete"] and metrics["backbone"] == "tiny_clip"
    acc = metrics["acc_matrix"]
    # nothing trained: task 0's accuracy changes only because task 1's classes become allowed, and the
    # loss on task 0 (over its own classes) does not change at all
    assert acc[1][0] <= acc[0][0]
    first = metrics["first_task_loss"]
    assert len(first) == 2 and first[0] > 0 and abs(first[1] - first[0]) < 1e-6


def test_star_prompt_runs_both_levels_as_pipeline_stages_on_two_ranks(assets, clip_backbone, tmp_path):
    from conftest import EVALUATE, launch, tiny_config

    cfg = tiny_config(assets, tmp_path, "star", data={"tasks": ["task0", "task1"]},
                      method={"name": "star_prompt", "clip_path": str(clip_backbone), "mog_components": 2,
                              "mog_iters_first": 20, "mog_iters_second": 20, "gr_first_epochs": 1,
                              "gr_second_epochs": 1, "gr_samples": 16, "first_epochs": 1},
                      train={"epochs": 1, "deepspeed_config": "deepspeed_configs/zero2.json"})
    res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "star"
    state = json.loads((run / "state.json").read_text())
    assert state["completed"][:5] == ["zero_shot", "0/train.first", "0/subspace.first", "0/train.second",
                                      "0/subspace.second"]
    log = [json.loads(line) for line in (run / "logs" / "train.jsonl").read_text().splitlines()]
    reports = [r for r in log if r.get("event") == "subspace"]
    assert len(reports) == 4 and all(len(set(r["state_sha256_per_rank"])) == 1 for r in reports)
    assert "gr_second_loss" in reports[-1]
    from mcit.models.zoo import sha256_path

    record = json.loads((run / "backbone.json").read_text())["auxiliary"]["clip"]  # the CLIP, through the zoo
    assert record["sha256"] == sha256_path(clip_backbone) and record["tag"] == "local"
    metrics = json.loads((run / "metrics.json").read_text())
    res = launch(["--run", str(run), "--task-checkpoint", "1", "--batch-size", "7", "--recompute"], entry=EVALUATE)
    assert res.returncode == 0, res.stderr[-3000:]
    row = json.loads((run / "eval" / "evaluate" / "after_task_1.json").read_text())
    assert row["acc"] == metrics["acc_matrix"][1]
