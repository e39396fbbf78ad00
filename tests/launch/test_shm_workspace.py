"""Launched runs leave no DeepSpeed shared-memory workspace behind."""

from __future__ import annotations

import os

import pytest


@pytest.mark.parametrize("nproc", [1, 2])
def test_launched_run_leaves_no_deepspeed_shm_workspace(tmp_path, nproc):
    """DeepSpeed's CPU shm allreduce never unlinks its 69 MB per-rank segment (a single launched rank
    gets one too: sweeps run such points by the dozen); init() does, while the ranks still run (so a
    killed run leaks nothing either) and the shm allreduce keeps working."""
    import json
    import subprocess
    from pathlib import Path

    from conftest import ROOT, free_port, launcher_cmd, run_env

    if os.environ.get("MCIT_TEST_ACCELERATOR", "cpu") != "cpu":
        pytest.skip("DeepSpeed's shm allreduce belongs to its CPU accelerator; CUDA ranks reduce through NCCL")
    port = free_port()
    cmd = [launcher_cmd("deepspeed", nproc), "--num_gpus", str(nproc), "--master_port", str(port),
           "--no_local_rank", str(ROOT / "tests" / "launch" / "workers" / "shm_workspace.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    for rec in records:
        assert rec["shm_op"], "DeepSpeed's shm comm op did not load, so this test checks nothing"
        assert rec["path"].endswith(f"_127.0.0.1_{port}_{rec['rank']}")
        assert not rec["exists"], f"{rec['path']} still exists after init()"
        assert rec["sum"] == [nproc * (nproc + 1) / 2] * 4
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
