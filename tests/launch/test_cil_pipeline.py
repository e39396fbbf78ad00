"""Every CIL method through the 2-rank DeepSpeed pipeline, and evaluate.py reproducing its rows."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("method, zero", [
    ({"name": "hide_prompt", "prompt_length": 2, "e_layers": [0, 1], "ca_epochs": 3}, "zero2"),
])
def test_method_runs_through_the_deepspeed_pipeline_and_evaluates_alike(method, zero, assets, tmp_path):
    """2 CPU ranks: param groups, the subspace stage (HiDe's class Gaussians and task-adaptive
    prediction on rank 0); a 1-process evaluation-only pass on the task-1 export gives the stored row
    exactly. (The methods with projected updates, VPT-NSP² among them, run under every ZeRO stage in
    test_zero_projection.py.)"""
    import json

    from conftest import EVALUATE, launch, tiny_config

    cfg = tiny_config(assets, tmp_path, method["name"], method=method,
                      data={"tasks": ["task0", "task1"]},
                      train={"epochs": 1, "deepspeed_config": f"deepspeed_configs/{zero}.json"})
    res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = tmp_path / "runs" / method["name"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["complete"] and len(metrics["acc_matrix"]) == 2
    log = [json.loads(line) for line in (run_dir / "logs" / "train.jsonl").read_text().splitlines()]
    report = [r for r in log if r.get("event") == "subspace"]
    assert len(report) == 2 and len(set(report[-1]["state_sha256_per_rank"])) == 1
    assert "tap_loss" in report[-1]
    res = launch(["--run", str(run_dir), "--task-checkpoint", "1", "--batch-size", "7", "--recompute"],
                 entry=EVALUATE)
    assert res.returncode == 0, res.stderr[-3000:]
    row = json.loads((run_dir / "eval" / "evaluate" / "after_task_1.json").read_text())
    assert row["acc"] == metrics["acc_matrix"][1]
