"""Process-group set-up: JIT extension builds cannot hang a run on a lock left by a killed build."""

from __future__ import annotations

import os
import time

import pytest

from mcit.core.distributed import prepare_extension_dir


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


