"""Sweeps: seeds x task orders x settings expand to ordinary, validated run directories; bad specs fail in
one line. (Launched sweeps: tests/launch/test_sweep_launch.py; the Slurm array: tests/launch/test_slurm.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import ROOT, sweep_spec

from mcit.core.config import ConfigError
from mcit.studies import spec as S


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
    p = next(p for p in points
             if p.config == "l2p" and p.order == "3" and p.seed == 1 and p.setting["train.lr"] == 0.05)
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
    from mcit.data.shards import open_split

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
            labels = [int(s["cls"]) for i in range(len(split.shard_counts)) for s in split.shard_samples(i)]
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




def test_study_rule_takes_the_best_validation_setting_unless_the_gap_is_inside_the_seed_noise(tmp_path):
    import shutil

    from mcit.studies.study import select

    shutil.copy(ROOT / "configs" / "tiny_mcit_lora.yaml", tmp_path / "lora.yaml")  # its own lr: 0.002

    def row(lr, mean, std):
        return {"config": "lora", "setting": {"train.lr": lr}, "metrics": {"final_avg_acc": {"mean": mean, "std": std}}}

    own, near, far = row(0.002, 60.0, 2.0), row(0.006, 61.5, 1.0), row(0.0007, 70.0, 1.0)
    assert select([near, own], tmp_path)["lora"] is own  # 1.5 points better, inside a 2-point spread
    assert select([near, own, far], tmp_path)["lora"] is far  # 10 points better: the rule moves the default
    assert select([row(0.006, 65.0, 1.0), own], tmp_path)["lora"]["setting"] == {"train.lr": 0.006}


def test_the_study_page_holds_its_tables_and_figures_and_opens_offline(tmp_path):
    """``write_study`` writes ``<out>.html`` beside ``<out>.md``: the selection table (the chosen row marked) and
    the test-split table, every mean and std as the aggregates hold them, sortable, and the figures inlined; in
    headless Chromium: no console message, no request."""
    import json

    import browser

    from mcit.studies.study import write_study

    def group(lr: float, base: float, std: float) -> dict:
        metrics = {k: {"mean": base - 7 * i, "std": std, "values": []}
                   for i, k in enumerate(["final_avg_acc", "forgetting", "bwt", "fwd"])}
        return {"config": "tiny_mcit_lora", "method": "lora", "setting": {"train.lr": lr},
                "setting_label": f"train.lr={lr}", "n": 3, "points": [], "metrics": metrics,
                "acc_matrix_mean": [[80.0, 10.0], [60.0, 70.0]], "tasks": ["a", "b"]}

    sweeps = {}
    for name, groups in (("sel", [group(0.002, 60.0, 2.0), group(0.02, 71.5, 1.0)]), ("fin", [group(0.02, 69.0, 1.5)])):
        sweeps[name] = tmp_path / name
        sweeps[name].mkdir()
        (sweeps[name] / "aggregate.json").write_text(json.dumps({"sweep": name, "groups": groups}))
    text, made = write_study([sweeps["sel"]], sweeps["fin"], tmp_path / "study")
    page_file = tmp_path / "study.html"
    assert page_file in made and (tmp_path / "study.md").is_file()
    html = page_file.read_text()
    assert html.count("(chosen)") == 1 and "train.lr=0.02 <b" in html  # 11.5 points better: outside the noise
    assert html.count("data:image/png;base64,") == len(made) - 1 and "http" not in html.replace("http://www.w3.org", "")
    assert browser.missing() is None, browser.missing()
    page = browser.open_report(page_file, tmp_path / "study.png")
    assert page["console"] == [] and page["requests"] == []
    rows = page["tables"]["study"]
    assert [float(r["final_avg_acc"]) for r in rows] == [60.0, 71.5, 69.0]
    assert [float(r["forgetting"]) for r in rows] == [53.0, 64.5, 62.0]
    unsorted, up, down = page["sort"]
    assert up == sorted(unsorted, key=float) and down == up[::-1]
    # the published numbers beside the final sweep's (``mcit-study --published``), in the text and the page
    pub = tmp_path / "pub.yaml"
    pub.write_text(yaml.safe_dump({"paper": "P", "arxiv": "1", "rows": [
        {"table": "T1", "setting": "s", "method": "LoRA", "benchmark": "b", "metric": "final_avg_acc", "value": 70.0,
         "where": "T1", "config": "configs/tiny_mcit_lora.yaml"}]}))
    text, made = write_study([sweeps["sel"]], sweeps["fin"], tmp_path / "study", [pub])
    assert "| LoRA | final_avg_acc | 70.00 | 69.00 ± 1.50 | -1.00 | tiny_mcit_lora |" in text
    assert 'data-key="delta" data-value="-1.0"' in page_file.read_text()


def test_the_shipped_published_files_load_and_each_matched_row_names_a_shipped_config_by_its_run_name():
    """published/*.yaml (the seed papers' tables): every row checked by the loader, and a row's config a shipped
    config whose run is named as its file (``mcit-report --published`` matches runs and sweep groups by it)."""
    from mcit.core.config import load_config
    from mcit.studies.published import load

    files = sorted((ROOT / "published").glob("*.yaml"))
    assert [f.name for f in files] == ["norga.yaml", "soft_tf.yaml"]
    for f in files:
        rows = load(f)
        matched = [r for r in rows if r.config]
        assert len(rows) > 100 and matched
        for config in {r.config for r in matched}:
            assert load_config(ROOT / config).name == Path(config).stem, config
