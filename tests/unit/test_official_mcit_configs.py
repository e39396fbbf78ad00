"""The MCIT benchmark configs against the official scripts, key by key: every value MCITlib's training scripts
and task JSONs (and, for Replay / EWC / LwF, Continual-NExT's) give, read from the official checkouts into
tests/reference/official/mcit_configs.json (file:line of each), equals what the config runs with (its own value
or the method's default). docs/official_configs.md shows the same table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from mcit.core.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
OFFICIAL = json.loads((ROOT / "tests" / "reference" / "official" / "mcit_configs.json").read_text())["configs"]
METHODS = ("modal_prompt", "cl_moe", "hide_llava", "sefe", "disco", "replay", "ewc", "lwf")


def value_of(cfg: RunConfig, key: str) -> Any:
    """What the run uses for ``key`` (the JSON's key grammar)."""
    tasks = cfg.data.tasks
    if key == "data.tasks[*].name":
        return [t if isinstance(t, str) else t.name for t in tasks]
    if key.startswith("data.tasks[") and key.endswith("].epochs"):
        return cfg.task_epochs(int(key[len("data.tasks["):-len("].epochs")]))
    if key == "train.epochs":  # one value for the whole sequence: every task runs it
        epochs = {cfg.task_epochs(i) for i in range(len(tasks))}
        return epochs.pop() if len(epochs) == 1 else sorted(epochs)
    if key == "train.deepspeed_config":  # load_config makes it absolute
        return Path(cfg.train.deepspeed_config).resolve().relative_to(ROOT).as_posix()
    if key == "_zero_stage":
        return json.loads((ROOT / cfg.train.deepspeed_config).read_text())["zero_optimization"]["stage"]
    if key == "_num_tasks":
        return len(tasks)
    if key == "_clip_is_vision_tower":
        return Path(cfg.method.params().clip_path).name == "clip-vit-large-patch14-336"
    section, name = key.split(".", 1)
    node = cfg.method.params() if section == "method" else getattr(cfg, section)
    return getattr(node, name)


def same(ours: Any, official: Any) -> bool:
    if isinstance(official, float) and isinstance(ours, (int, float)) and not isinstance(ours, bool):
        return math.isclose(ours, official, rel_tol=1e-12)
    return ours == official


def test_every_mcit_method_has_official_configs_and_every_table_a_config():
    shipped = {p.stem for p in (ROOT / "configs").glob("*_llava7b_*.yaml") if p.stem.split("llava7b_")[1] in METHODS}
    assert shipped == set(OFFICIAL)
    for m in METHODS:
        assert f"ucit_llava7b_{m}" in OFFICIAL
    for m in ("modal_prompt", "cl_moe", "hide_llava", "sefe", "disco"):  # MCITlib's MLLM-DCL scripts
        assert f"dcl_llava7b_{m}" in OFFICIAL
    doc = (ROOT / "docs" / "official_configs.md").read_text()
    assert all(f"### {name} " in doc for name in OFFICIAL)


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_mcit_config_runs_the_official_values(name):
    entry = OFFICIAL[name]
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    assert cfg.method.name == entry["method"]
    wrong = [f"{r['key']}: ours {value_of(cfg, r['key'])!r}, official {r['value']!r} ({r['official']}; {r['source']})"
             for r in entry["rows"] if not same(value_of(cfg, r["key"]), r["value"])]
    assert not wrong, "\n".join(wrong)
    assert len(entry["rows"]) >= 15
