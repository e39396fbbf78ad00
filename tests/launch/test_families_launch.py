"""Every multimodal LLM family (``MLLMBackbone.families()``) under the DeepSpeed launcher: prompt tuning, Fwd-Prompt
and LoRA (with its trainable projector) each run a whole 2-task sequence on the family's tiny checkpoint on 2 CPU
ranks, end to end (pre-flight, train, subspace, eval, commit). One launch runs all of them
(``run_task_sequence.py`` with one ``--config`` per run): 3 x families runs for one launcher start."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from conftest import built_once, launch_failure, launch_sequences, mcit_config, run_main

from mcit.models.mllm import MLLMBackbone

METHODS = {"prompt_tuning": {"prompt_length": 2}, "fwd_prompt": {"pool_size": 4, "top_n": 2, "prompt_length": 2},
           "lora": {"r": 2, "alpha": 4, "train_projector": True, "projector_lr": 0.01}}


@pytest.fixture(scope="module")
def family_assets(tmp_path_factory) -> dict[str, Path]:
    """A small embedded benchmark and each family's tiny checkpoint."""
    from data_prep.tiny_mcit import build
    from mcit.data import tiny_mcit as B

    def make(base: Path) -> None:
        build(base / "shards", seed=0, n_train=16, n_test=8, n_base=16, n_base_test=16, shard_size=8)
        for fam in shipped():
            model, processor = fam.tiny(B.corpus(), seed=0)
            model.save_pretrained(base / fam.kind)
            processor.save_pretrained(base / fam.kind)

    base = built_once(tmp_path_factory, "family_assets", make)
    return {"shards": base / "shards", **{f.kind: base / f.kind for f in shipped()}}


def shipped() -> list[type[MLLMBackbone]]:
    """The families mcit ships (a test module may have registered more in this process; the launched ranks would
    not know them)."""
    return [f for f in MLLMBackbone.families() if f.__module__.startswith("mcit.")]


def test_each_family_runs_prompt_tuning_fwd_prompt_and_lora_sequences_under_deepspeed(family_assets, tmp_path):
    kinds = [f.kind for f in shipped()]
    configs = []
    for kind in kinds:
        for method, params in METHODS.items():
            path = mcit_config(
                {"shards": family_assets["shards"], "backbone": family_assets[kind]}, tmp_path, f"{kind}_{method}",
                backbone={"kind": kind, "path": str(family_assets[kind]), "tag": f"tiny_test_{kind}"},
                train={"batch_size": 8, "lr": 0.01, "checkpoint_every": 50, "log_every": 1},
                eval={"batch_size": 8, "max_new_tokens": 2, "zero_shot": False})
            cfg = yaml.safe_load(path.read_text())
            cfg["method"] = {"name": method, **params}  # this method's parameters only
            path.write_text(yaml.safe_dump(cfg))
            configs.append(path)
    res = launch_sequences(configs, timeout=1200)
    runs = [tmp_path / "runs" / c.stem for c in configs]
    assert res.returncode == 0, launch_failure(res, runs)
    # the same command again: every run finished, each prints its summary, nothing starts
    again = run_main([a for c in configs for a in ("--config", str(c))])
    assert again.returncode == 0 and again.stdout.count("run already finished") == len(configs), again.stderr
    for kind in kinds:
        for method in METHODS:
            run = tmp_path / "runs" / f"{kind}_{method}"
            metrics = json.loads((run / "metrics.json").read_text())
            assert metrics["complete"] and len(metrics["acc_matrix"]) == 2, (kind, method)
            cells = [x for row in metrics["acc_matrix"] for x in row if x is not None]
            assert cells and all(math.isfinite(x) and 0 <= x <= 100 for x in cells)
            steps = [json.loads(x) for x in (run / "logs" / "train.jsonl").read_text().splitlines()]
            losses = [e["loss"] for e in steps if "loss" in e]
            assert losses and all(math.isfinite(x) for x in losses), (kind, method)
