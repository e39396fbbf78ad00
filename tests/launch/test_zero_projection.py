"""Projected updates under every ZeRO stage, on 2 ranks: every method that projects its updates
(Fwd-Prompt, VPT-NSP² on ViT and on CLIP, L2P+PGP, DualPrompt+PGP) runs two tasks under ZeRO-2, under
ZeRO-3 with its parameters partitioned, and under ZeRO-3 with its parameters kept gathered (at or below
``stage3_param_persistence_threshold``, DeepSpeed's default for every tensor under 1e5 elements); the
accuracy matrices are identical, and after every step the weights the next forward reads have moved
only inside the method's subspace. One launch per ZeRO set-up runs all five methods."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, free_port, launcher_cmd, mcit_config, run_env, tiny_config

ZERO = {
    "zero2": {"zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True}},
    "zero3_partitioned": {"zero_optimization": {"stage": 3, "overlap_comm": False,
                                                "stage3_param_persistence_threshold": 0}},
    "zero3_gathered": {"zero_optimization": {"stage": 3, "overlap_comm": False,
                                             "stage3_param_persistence_threshold": 1_000_000_000}},
}
METHODS = ("fwd_prompt", "vpt_nsp2", "vpt_nsp2_clip", "l2p_pgp", "dualprompt_pgp")


def _configs(assets, clip_backbone, mcit_assets, tmp: Path, zero: str) -> list[Path]:
    ds = tmp / f"{zero}.json"
    ds.write_text(json.dumps({**ZERO[zero], "zero_allow_untested_optimizer": True}))
    train = {"epochs": 1, "deepspeed_config": str(ds), "optimizer": "adam", "lr": 0.01}
    two = {"tasks": ["task0", "task1"]}
    clip = {"kind": "clip", "path": str(clip_backbone), "tag": "tiny_clip"}
    return [
        mcit_config(mcit_assets, tmp, f"fwd_prompt_{zero}", train=train, data={"num_workers": 0}),
        tiny_config(assets, tmp, f"vpt_nsp2_{zero}", data=two, train=train,
                    method={"name": "vpt_nsp2", "prompt_length": 2, "temperature": 2.0}),
        tiny_config(assets, tmp, f"vpt_nsp2_clip_{zero}", data=two, train=train, backbone=clip,
                    method={"name": "vpt_nsp2", "classifier": "text", "templates": ["a photo of the digit {}."],
                            "prompt_length": 2, "layers": [0, 1], "eta1": 0.98, "eta2": 0.98, "temperature": 1.0,
                            "refine_head": True}),
        tiny_config(assets, tmp, f"l2p_pgp_{zero}", data=two, train=train,
                    method={"name": "l2p+pgp", "pool_size": 4, "top_k": 2, "prompt_length": 2}),
        tiny_config(assets, tmp, f"dualprompt_pgp_{zero}", data=two, train=train,
                    method={"name": "dualprompt+pgp", "g_prompt_length": 2, "g_layers": [0],
                            "e_prompt_length": 2, "e_layers": [1], "project_e_key": True}),
    ]


@pytest.fixture(scope="module")
def runs(assets, clip_backbone, mcit_assets, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("zero")
    out: dict[str, dict] = {}
    for zero in ZERO:
        report = tmp / f"{zero}_report.json"
        cmd = [launcher_cmd("deepspeed", 2), "--num_gpus", "2", "--master_port", str(free_port()),
               str(ROOT / "tests" / "launch" / "workers" / "zero_equivalence.py"), str(report),
               *map(str, _configs(assets, clip_backbone, mcit_assets, tmp, zero))]
        r = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        checks = json.loads(report.read_text())
        for method in METHODS:
            metrics = json.loads((tmp / "runs" / f"{method}_{zero}" / "metrics.json").read_text())
            out[f"{method}/{zero}"] = {"check": checks[f"{method}_{zero}"], "metrics": metrics,
                                       "run": tmp / "runs" / f"{method}_{zero}"}
    return out


@pytest.mark.parametrize("method", METHODS)
def test_zero2_and_zero3_give_identical_accuracy_matrices(runs, method):
    got = {zero: runs[f"{method}/{zero}"]["metrics"] for zero in ZERO}
    assert all(m["complete"] and len(m["acc_matrix"]) == 2 for m in got.values())
    ref = got["zero2"]
    for zero, m in got.items():
        assert m["acc_matrix"] == ref["acc_matrix"], (zero, m["acc_matrix"], ref["acc_matrix"])
        log = (runs[f"{method}/{zero}"]["run"] / "logs" / "train.jsonl").read_text().splitlines()
        reports = [r for r in map(json.loads, log) if r.get("event") == "subspace"]
        assert reports and all(len(set(r["state_sha256_per_rank"])) == 1 for r in reports)  # one basis on all ranks
        if method.startswith("vpt_nsp2"):
            assert reports[-1]["null_dims_qk"]


@pytest.mark.parametrize("method", METHODS)
def test_the_weights_the_forward_reads_are_the_projected_ones(runs, method):
    """After every step the weights the next forward reads are the previous ones plus the method's
    projection of the update; for the orthogonal projectors (Fwd-Prompt, PGP) they have moved only inside
    the projector's range (VPT-NSP²'s relaxed projector eta B + (1 - eta) I is not idempotent)."""
    # measured over the three ZeRO set-ups under MKL's default and reproducible paths and ATen's default, AVX2 and
    # AVX-512 kernels (2026-11-27): moved 1.3e-2 (VPT-NSP² on CLIP) to 0.81, read_vs_projected 3.7e-9 to 6.0e-8,
    # outside_subspace 8.6e-8 (Fwd-Prompt) to 1.2e-6 (L2P+PGP): the bounds sit 130x, 17x and 8x beyond them
    for zero in ZERO:
        check = runs[f"{method}/{zero}"]["check"]
        assert check["checked"] > 0 and check["moved"] > 1e-4, (zero, check)
        assert check["read_vs_projected"] < 1e-6, (zero, check)  # float32 rounding; unprojected: ~1e-2
        if not method.startswith("vpt_nsp2"):
            assert check["outside_subspace"] < 1e-5, (zero, check)
