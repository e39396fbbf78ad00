"""``bench/instrument.py``: what it reports about a benchmark's spread is computed from the runs it names (the
seeds' std, each kernel set's seed 0, the zero-shot rows, where the spread sits, which part pre-training brings),
and the CIL spec it measures is the Makefile's list of CIL configs."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from bench import instrument as I

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def _metrics(final_row: list[float], zero_shot: list[float] | None = None, forgetting: float = 10.0) -> dict:
    """A finished two-task run's metrics.json (only the keys the instrument reads)."""
    first = [final_row[0] + forgetting, 0.0]
    return {"complete": True, "tasks": ["a", "b"], "schedule": "sequential", "acc_matrix": [first, final_row],
            "zero_shot": zero_shot, "final_avg_acc": statistics.fmean(final_row), "forgetting": forgetting}


def _write(out: Path, label: str, config: str, seed: int, m: dict) -> None:
    d = out / "sweeps" / label / "runs" / f"{config}__s{seed}_o0"
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps(m))


def test_the_cil_spec_is_the_makefile_s_list_of_cil_configs():
    make = (ROOT / "Makefile").read_text()
    methods = re.search(r"^CIL_METHODS\s*\?=\s*(.+)$", make, re.M).group(1).split()
    from mcit.core.config import read_yaml_mapping

    spec = read_yaml_mapping(ROOT / I.BENCHMARKS["cil"].spec)
    assert spec["configs"] == [f"configs/digits_{m}.yaml" for m in methods]
    mcit = read_yaml_mapping(ROOT / I.BENCHMARKS["mcit"].spec)
    assert all((ROOT / c).is_file() for c in spec["configs"] + mcit["configs"])


def test_a_kernel_set_s_environment_replaces_what_the_caller_set(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX512_CORE")
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    env = I.kernel_env("avx2")
    assert "MKL_CBWR" not in env
    assert (env["ATEN_CPU_CAPABILITY"], env["DNNL_MAX_CPU_ISA"], env["OMP_NUM_THREADS"]) == ("avx2", "AVX2", "1")
    native = I.kernel_env("native")
    assert "ATEN_CPU_CAPABILITY" not in native and "DNNL_MAX_CPU_ISA" not in native


def test_configs_point_at_the_kernel_set_s_backbones(tmp_path):
    text = "backbone:\n  path: data/backbones/tiny_llava\nmethod:\n  clip_path: data/backbones/tiny_clip_procedural\n"
    out = I.rewrite_config(text, tmp_path / "backbones" / "avx2")
    assert f"path: {tmp_path}/backbones/avx2/tiny_llava" in out
    assert f"clip_path: {tmp_path}/backbones/avx2/tiny_clip_procedural" in out
    assert "data/backbones" not in out


def test_the_plan_runs_every_seed_once_and_seed_0_per_kernel_set():
    sweeps = I.plan(["native", "avx2", "default"], [0, 1, 2], split_source=True)
    assert [(s.label, s.kernel_set, s.backbones, s.seeds) for s in sweeps] == [
        ("native", "native", "native", (0, 1, 2)), ("avx2", "avx2", "avx2", (0,)),
        ("default", "default", "default", (0,)), ("avx2-on-native", "avx2", "native", (0,)),
        ("default-on-native", "default", "native", (0,))]


def test_the_summary_finds_the_spread_and_splits_it_by_source(tmp_path, capsys):
    """Task b is the one that moves over seeds; avx2's backbones move the zero-shot row and most of seed 0's number."""
    runs = {"native": {0: _metrics([90.0, 40.0], [50.0, 10.0]), 1: _metrics([90.5, 60.0], [50.0, 10.0]),
                       2: _metrics([89.5, 50.0], [50.0, 10.0])},
            "avx2": {0: _metrics([90.0, 46.0], [52.0, 10.5])},
            "avx2-on-native": {0: _metrics([90.0, 41.0], [50.0, 10.0])}}
    s = I.summarise(runs, seed_label="native", kernel_labels=["native", "avx2"],
                    source_labels={"avx2": "avx2-on-native"}, seed0=0)
    assert s["final_avg_acc"] == {0: 65.0, 1: 75.25, 2: 69.75}
    assert s["seed_std"] == pytest.approx(statistics.stdev([65.0, 75.25, 69.75]))
    assert s["per_kernel"] == {"native": 65.0, "avx2": 68.0} and s["kernel_range"] == pytest.approx(3.0)
    assert s["task_seed_std"]["b"] == pytest.approx(10.0) and s["task_seed_std"]["a"] == pytest.approx(0.5)
    assert s["task_kernel_range"] == {"a": 0.0, "b": 6.0}
    assert s["zero_shot_range"] == pytest.approx(1.25) and s["zero_shot_cell_range"] == pytest.approx(2.0)
    assert s["source"]["avx2"] == pytest.approx({"continual_only": 0.5, "pretraining": 2.5, "total": 3.0})
    assert s["row_seed_std"][0] == pytest.approx(statistics.stdev([100.0, 100.5, 99.5]))
    assert I.verdict(s) == [f"seed std {s['seed_std']:.2f} > 2", "kernel range 3.00 > 2"]

    # The same runs on disk through the program's --report-only pass: the report's rows carry these numbers.
    for label, by_seed in runs.items():
        for seed, m in by_seed.items():
            _write(tmp_path, label, "tiny_mcit_lora", seed, m)
    assert I.main(["--benchmark", "mcit", "--methods", "lora", "--kernel-sets", "native", "avx2", "--split-source",
                   "--report-only", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "instrument.md").read_text()
    assert "| lora | 70.00 ± 5.13 | 65.00–75.25 | 65.00 | 68.00 | 3.00 | 10.00 ± 0.00 |" in text
    assert "| lora | +0.50 / +2.50 / +3.00 |" in text
    assert "Sequential `lora` forgets 10.00 ± 0.00 points (target ≥ 20: missed)" in text
    assert json.loads((tmp_path / "instrument.json").read_text())["summaries"]["lora"]["kernel_range"] == 3.0


def test_only_the_backbones_the_chosen_configs_load_are_pre_trained():
    mcit = I.BENCHMARKS["mcit"]
    assert I.needed_backbones(mcit, [Path("configs/tiny_mcit_lora.yaml")]) == ["tiny_llava"]
    assert I.needed_backbones(mcit, [Path("configs/tiny_mcit_lora.yaml"), Path("configs/tiny_mcit_disco.yaml")]) == [
        "tiny_llava", "tiny_clip_procedural"]
    assert I.needed_backbones(I.BENCHMARKS["cil"], [Path("configs/digits_clip_zero_shot.yaml")]) == [
        "tiny_clip_procedural"]
