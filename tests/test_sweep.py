"""Sweeps: seeds x task orders x settings expand to ordinary run directories; a local sweep through the
DeepSpeed launcher runs end to end, re-runs only unfinished points, lists failed ones, and its table
equals the mean / std recomputed from the runs. (The Slurm array is tested in tests/test_slurm.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import yaml

from conftest import ROOT, check_aggregate_against_runs, run_env, sweep_spec, tiny_config
from mcit import sweep as S
from mcit.config import ConfigError


def _sweep(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.sweep", *args], cwd=ROOT, env=run_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_cli_orders_and_grid_parse():
    assert S.parse_orders(["0-2", "5", "2,0,1"]) == [0, 1, 2, 5, [2, 0, 1]]
    assert S.parse_grid(["method.eta=1.0,0.95", "method.gate=true,false"]) == {
        "method.eta": [1.0, 0.95], "method.gate": [True, False]}
    with pytest.raises(ConfigError, match="--orders: 'x'"):
        S.parse_orders(["x"])


def test_points_are_validated_configs_with_their_order_and_setting_recorded(assets, tmp_path):
    spec = S.load_spec(sweep_spec(assets, tmp_path, order_unit="task", orders=[0, 3, [1, 0]],
                                  grid={"train.lr": [0.01, 0.05]}), {})
    points = S.expand(spec)
    assert len(points) == 2 * 2 * 3 * 2  # configs x settings x orders x seeds
    assert len({p.name for p in points}) == len(points)
    p = next(p for p in points if p.config == "l2p" and p.order == "3" and p.seed == 1 and p.setting["train.lr"] == 0.05)
    assert p.name == "l2p__train.lr=0.05__s1_o3" and p.cfg.seed == 1 and p.cfg.train.lr == 0.05
    perm = np.random.RandomState(3).permutation(2).tolist()
    assert p.cfg.data.tasks == [["task0", "task1"][i] for i in perm] and p.meta["permutation"] == p.cfg.data.tasks
    explicit = next(p for p in points if p.order == "p2")
    assert explicit.cfg.data.tasks == ["task1", "task0"]
    S.write_points(spec, points)
    written = yaml.safe_load(p.config_path.read_text())
    assert written["meta"]["order"] == "3" and written["meta"]["setting"] == {"train.lr": 0.05}
    assert written["run_dir"] == str(p.run_dir)


def test_class_orders_regroup_the_shards_into_tasks_of_the_same_sizes(assets, tmp_path):
    from mcit.data.shards import open_split, tar_samples

    spec = S.load_spec(sweep_spec(assets, tmp_path, orders=[0, 2], seeds=[0]), {})
    points = [p for p in S.expand(spec) if p.config == "l2p"]
    base, shuffled = points
    assert base.meta["order_unit"] == "class" and base.cfg.data.tasks == ["task0", "task1"]  # order 0: as given
    source = [open_split(assets["shards"] / t / "train").label_space for t in ("task0", "task1")]
    classes = [c for s in source for c in s]
    expected = [classes[i] for i in np.random.RandomState(2).permutation(4)]
    assert shuffled.meta["permutation"] == expected
    for j, task in enumerate(shuffled.cfg.data.tasks):
        for kind in ("train", "test"):
            split = open_split(getattr(task, kind))
            assert split.label_space == sorted(expected[2 * j:2 * j + 2])
            labels = [int(s["cls"]) for f in split.shard_files for s in tar_samples(f)]
            assert set(labels) == set(expected[2 * j:2 * j + 2]) and len(labels) == split.num_samples > 0
    total = sum(open_split(t.train).num_samples for t in shuffled.cfg.data.tasks)
    assert total == sum(open_split(assets["shards"] / t / "train").num_samples for t in ("task0", "task1"))


def test_bad_specs_fail_in_one_line_before_any_run(assets, tmp_path):
    with pytest.raises(ConfigError, match=r"sweep spec error in .*sweep.yaml: seed: unknown key"):
        S.load_spec(sweep_spec(assets, tmp_path, seed=[0]), {})
    spec = S.load_spec(sweep_spec(assets, tmp_path, order_unit="task", orders=[[0, 0]]), {})
    with pytest.raises(ConfigError, match=r"\[0, 0\] is not a permutation of the task indices 0..1"):
        S.expand(spec)
    spec = S.load_spec(sweep_spec(assets, tmp_path, grid={"method.no_such_key": [1, 2]}), {})
    with pytest.raises(ConfigError, match=r"method.no_such_key: unknown key"):
        S.expand(spec)
    assert not (tmp_path / "sweep").exists()


def test_local_sweep_runs_every_point_through_deepspeed_and_aggregates(assets, tmp_path):
    """2 methods x 2 seeds x 2 class orders on the embedded digits benchmark (tiny ViT, 2 tasks, 1 epoch),
    each run through the DeepSpeed launcher. Then the same sweep plus a config that cannot run: only
    that point runs, fails, is listed with its exit code and log, and the sweep exits 1."""
    spec = sweep_spec(assets, tmp_path)
    r = _sweep("--spec", str(spec), "--launch", "deepspeed", "--nproc", "1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "8 points, 0 finished, 8 to run (deepspeed" in r.stdout
    out = tmp_path / "sweep"
    agg = check_aggregate_against_runs(out, 8)
    assert {g["config"] for g in agg["groups"]} == {"l2p", "vpt_nsp2"}
    assert all(g["n"] == 4 and g["seeds"] == [0, 1] and g["orders"] == ["0", "1"] for g in agg["groups"])
    for f in ("aggregate.md", "aggregate.csv", "points.csv", "task_accuracy.png", "first_task_loss.png"):
        assert (out / f).is_file(), f
    assert "| l2p | l2p | tiny_test_vit | default | 4 |" in r.stdout
    m = json.loads((out / "runs" / "vpt_nsp2__s1_o1" / "metrics.json").read_text())
    assert m["meta"]["order_unit"] == "class" and len(m["first_task_loss"]) == 2
    assert all(np.isfinite(m["first_task_loss"]))

    bad = tiny_config(assets, tmp_path, "broken", method={"name": "seq"}, data={"tasks": ["task0", "task1"]},
                      backbone={"kind": "vit", "path": str(tmp_path / "no_such_backbone"), "tag": "x"})
    # options on the command line replace the spec's (grid keys and --set add to it)
    again = _sweep("--spec", str(spec), "--config", str(tmp_path / "l2p.yaml"), "--config", str(bad),
                   "--seeds", "0", "--orders", "0", "--launch", "deepspeed", "--nproc", "1")
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-3000:]
    assert "2 points, 1 finished, 1 to run" in again.stdout and "broken__s0_o0: FAILED (exit 2" in again.stdout
    agg = json.loads((out / "aggregate.json").read_text())
    assert [f["point"] for f in agg["failed"]] == ["broken__s0_o0"] and agg["failed"][0]["reason"] == "exit 2"
    assert "no_such_backbone" in (out / "logs" / "broken__s0_o0.log").read_text()
    assert "## Points that did not finish" in (out / "aggregate.md").read_text()
    l2p = next(g for g in agg["groups"] if g["config"] == "l2p")
    assert l2p["n"] == 1 and l2p["metrics"]["final_avg_acc"]["std"] is None  # one run: no std
