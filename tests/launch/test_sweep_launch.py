"""A sweep run locally: every point through the DeepSpeed launcher, re-running only unfinished points, listing
failed ones, and a table equal to the mean / std recomputed from the runs."""

from __future__ import annotations

import json
import subprocess
import sys

import browser
import numpy as np
from conftest import ROOT, check_aggregate_against_runs, run_env, sweep_spec, tiny_config


def _sweep(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.sweep", *args], cwd=ROOT, env=run_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_local_sweep_runs_every_point_through_deepspeed_and_aggregates(assets, tmp_path, capsys):
    """2 methods x 2 seeds on a seeded class order of the embedded digits benchmark (tiny ViT, 2 tasks, 1
    epoch), each run through the DeepSpeed launcher (seeds x class orders also run as a Slurm job array in
    tests/launch/test_slurm.py). Then the same sweep plus a config that cannot run: only that point runs,
    fails, is listed with its exit code and log, and the sweep exits 1."""
    spec = sweep_spec(assets, tmp_path, orders=[1])
    r = _sweep("--spec", str(spec), "--launch", "deepspeed", "--nproc", "1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "4 points, 0 finished, 4 to run (deepspeed" in r.stdout
    out = tmp_path / "sweep"
    agg = check_aggregate_against_runs(out, 4)
    assert {g["config"] for g in agg["groups"]} == {"l2p", "vpt_nsp2"}
    assert all(g["n"] == 2 and g["seeds"] == [0, 1] and g["orders"] == ["1"] for g in agg["groups"])
    for f in ("aggregate.md", "aggregate.csv", "points.csv", "task_accuracy.png", "first_task_loss.png"):
        assert (out / f).is_file(), f
    assert "| l2p | l2p | tiny_test_vit | default | 2 |" in r.stdout
    md, l2p = (out / "aggregate.md").read_text(), next(g for g in agg["groups"] if g["config"] == "l2p")
    cells = " | ".join(f"{l2p['metrics'][k]['mean']:.2f} ± {l2p['metrics'][k]['std']:.2f}"
                       for k in ("mft", "mfn", "maa", "bwt"))
    assert "## MCITlib's columns" in md and f"| l2p | default | 2 | {cells} |" in md  # MFT, MFN, MAA, BWT
    # report.html of the sweep in headless Chromium: offline, its table the aggregate's means and stds, sortable
    assert browser.missing() is None, browser.missing()
    shot = tmp_path / "sweep_report.png"
    page = browser.open_report(out / "report.html", shot)
    print(f"\n== screenshot of the sweep's report.html: {shot}")
    assert page["console"] == [] and page["requests"] == [] and page["colours"] > 100
    shown = page["tables"]["sweep"]
    assert len(shown) == len(agg["groups"]) == 2
    for row, g in zip(shown, agg["groups"]):
        assert int(row.pop("n")) == g["n"]
        assert row and {k: float(v) if v else None for k, v in row.items()} == {k: g["metrics"][k]["mean"] for k in row}
    assert {"final_avg_acc", "forgetting", "bwt", "mft", "mfn", "maa"} <= set(shown[0])
    html = (out / "report.html").read_text()
    for g in agg["groups"]:  # each std as the page holds it
        assert f'data-std="{g["metrics"]["final_avg_acc"]["std"]!r}"' in html
    unsorted, up, down = page["sort"]
    assert sorted(unsorted, key=float) == up and up == sorted(up, key=float) and down == up[::-1]
    _published_beside_the_sweep(out, agg, tmp_path, capsys)
    m = json.loads((out / "runs" / "vpt_nsp2__s1_o1" / "metrics.json").read_text())
    assert m["meta"]["order_unit"] == "class" and len(m["first_task_loss"]) == 2
    assert all(np.isfinite(m["first_task_loss"]))

    bad = tiny_config(assets, tmp_path, "broken", method={"name": "seq"}, data={"tasks": ["task0", "task1"]},
                      backbone={"kind": "vit", "path": str(tmp_path / "no_such_backbone"), "tag": "x"})
    # options on the command line replace the spec's (grid keys and --set add to it)
    again = _sweep("--spec", str(spec), "--config", str(tmp_path / "l2p.yaml"), "--config", str(bad),
                   "--seeds", "0", "--orders", "1", "--launch", "deepspeed", "--nproc", "1")
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-3000:]
    assert "2 points, 1 finished, 1 to run" in again.stdout and "broken__s0_o1: FAILED (exit 2" in again.stdout
    agg = json.loads((out / "aggregate.json").read_text())
    assert [f["point"] for f in agg["failed"]] == ["broken__s0_o1"] and agg["failed"][0]["reason"] == "exit 2"
    assert "no_such_backbone" in (out / "logs" / "broken__s0_o1.log").read_text()
    assert "## Points that did not finish" in (out / "aggregate.md").read_text()
    l2p = next(g for g in agg["groups"] if g["config"] == "l2p")
    assert l2p["n"] == 1 and l2p["metrics"]["final_avg_acc"]["std"] is None  # one run: no std


def _published_beside_the_sweep(out, agg: dict, tmp_path, capsys) -> None:
    """``mcit-report --published`` on the sweep: published, ours (mean ± std of the sweep) and Δ per row; a row of
    another benchmark is left out and counted; a wrong metric name, or a method of a covered benchmark the sweep
    lacks, is one line and exit 2."""
    import yaml

    from mcit.cli.report import main

    g = {x["config"]: x["metrics"] for x in agg["groups"]}

    def row(config, metric, value, benchmark="digits_2"):
        return {"table": "Table 1", "setting": "digits, 2 tasks", "method": config.upper(), "benchmark": benchmark,
                "metric": metric, "value": value, "where": "Table 1", "config": f"configs/{config}.yaml"}

    def published(name, rows):
        (tmp_path / name).write_text(yaml.safe_dump({"paper": "A paper", "arxiv": "2401.00001", "rows": rows}))
        return tmp_path / name

    good = published("good.yaml", [row("l2p", "final_avg_acc", 40.0), row("vpt_nsp2", "forgetting", 30.5),
                                    row("coda_prompt", "final_avg_acc", 50.0, benchmark="cifar100_10")])
    capsys.readouterr()
    assert main(["--published", str(good), str(out)]) == 0
    text = capsys.readouterr().out
    l2p, vpt = g["l2p"]["final_avg_acc"], g["vpt_nsp2"]["forgetting"]
    assert (f"| L2P | final_avg_acc | 40.00 | {l2p['mean']:.2f} ± {l2p['std']:.2f} | "
            f"{l2p['mean'] - 40.0:+.2f} | l2p |") in text
    assert (f"| VPT_NSP2 | forgetting | 30.50 | {vpt['mean']:.2f} ± {vpt['std']:.2f} | "
            f"{vpt['mean'] - 30.5:+.2f} |") in text
    assert "1 published rows of benchmarks not in this report left out" in text
    for name, rows, expect in (
            ("metric.yaml", [row("l2p", "accuracy", 40.0)], "row 0 (L2P, Table 1): unknown metric 'accuracy'"),
            ("lacks.yaml", [row("l2p", "final_avg_acc", 40.0), row("coda_prompt", "final_avg_acc", 45.0)],
             "row 1 (CODA_PROMPT, Table 1, digits_2): the report has no run of configs/coda_prompt.yaml")):
        assert main(["--published", str(published(name, rows)), str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expect in err[0] and str(tmp_path / name) in err[0], err
