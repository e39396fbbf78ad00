"""Process-group set-up: JIT extension builds cannot hang a run on a lock left by a killed build."""

from __future__ import annotations

import os
import time

import pytest

from mcit.distributed import prepare_extension_dir


def test_stale_extension_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old = tmp_path / "deepspeed_shm_comm" / "lock"
    fresh = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    for f in (old, fresh):
        f.parent.mkdir(parents=True)
        f.touch()
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    with pytest.warns(UserWarning, match="stale extension build lock"):
        assert prepare_extension_dir(stale_after_s=900) == tmp_path
    assert not old.exists() and fresh.exists()


def test_extension_dir_defaults_to_this_environment(monkeypatch):
    import sys

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "recorded so that the test's change is undone")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    root = prepare_extension_dir()
    if os.access(sys.prefix, os.W_OK):
        assert str(root).startswith(sys.prefix)
    assert os.environ.get("TORCH_EXTENSIONS_DIR", str(root)) == str(root)


@pytest.mark.parametrize("nproc", [1, 2])
def test_launched_run_leaves_no_deepspeed_shm_workspace(tmp_path, nproc):
    """DeepSpeed's CPU shm allreduce never unlinks its 69 MB per-rank segment (a single launched rank
    gets one too: sweeps run such points by the dozen); init() does, while the ranks still run (so a
    killed run leaks nothing either) and the shm allreduce keeps working."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import ROOT, free_port, run_env

    port = free_port()
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(port),
           "--no_local_rank", str(ROOT / "tests" / "workers" / "shm_workspace.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    for rec in records:
        assert rec["shm_op"], "DeepSpeed's shm comm op did not load, so this test checks nothing"
        assert rec["path"].endswith(f"_127.0.0.1_{port}_{rec['rank']}")
        assert not rec["exists"], f"{rec['path']} still exists after init()"
        assert rec["sum"] == [nproc * (nproc + 1) / 2] * 4
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
