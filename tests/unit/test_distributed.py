"""Process-group set-up: JIT extension builds cannot hang a run on a lock left by a killed build."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mcit.core import extensions as E
from mcit.core.locks import LockTimeout

HOLD = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, b'{"pid": %d, "host": "h", "since": 0}' % os.getpid())
print("held", flush=True)
time.sleep(120)
"""


def _holder(path):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_torch_locks_left_by_a_killed_process_go_under_mcit_s_lock_and_are_named(tmp_path):
    """A torch build lock under the extensions root, however fresh, is removed once mcit's flock is held (no live
    mcit process can be inside torch's window then), and each removal names the file."""
    locks = [tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "py311_cpu" / "cpu_adam" / "lock"]
    for f in locks:
        f.parent.mkdir(parents=True)
        f.touch()
    said = []
    with E.extension_lock(tmp_path, timeout_s=5, say=said.append) as root:
        assert root == tmp_path and not any(f.exists() for f in locks)
    assert len(said) == 2 and all(str(f) in line for f, line in zip(sorted(locks), said))


def test_a_live_holder_bounds_the_wait_and_a_killed_one_frees_the_lock_at_once(tmp_path):
    """Another process holding the lock: the wait ends after the timeout in one line naming the file and the
    holder's pid. SIGKILL that process: the kernel drops its lock and the next taker gets it without waiting."""
    holder = _holder(tmp_path / E.LOCK_FILE)
    try:
        t0 = time.monotonic()
        with pytest.raises(LockTimeout) as e:
            with E.extension_lock(tmp_path, timeout_s=1.0, say=lambda s: None):
                pass
        took = time.monotonic() - t0
        assert 1.0 <= took < 5.0, took
        msg = str(e.value)
        assert str(tmp_path / E.LOCK_FILE) in msg and f"pid {holder.pid}" in msg and "\n" not in msg
    finally:
        holder.kill()
        holder.wait()
    t0 = time.monotonic()
    with E.extension_lock(tmp_path, timeout_s=1.0):
        assert time.monotonic() - t0 < 0.5


def test_the_ops_a_deepspeed_json_makes_deepspeed_load():
    assert E.ops_for(None) == ["ShareMemCommBuilder"]
    offload = {"optimizer": {"type": "AdamW"},
               "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert E.ops_for(offload) == ["ShareMemCommBuilder", "CPUAdamBuilder"]
    assert E.ops_for({"optimizer": {"type": "Adam"}}) == ["ShareMemCommBuilder", "FusedAdamBuilder"]
    assert E.ops_for({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}) == ["ShareMemCommBuilder"]
    assert E.ops_for({"optimizer": {"type": "SGD"}}) == ["ShareMemCommBuilder"]


def test_extension_dir_defaults_to_this_environment(monkeypatch):
    import sys

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "recorded so that the test's change is undone")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    root = E.extensions_root()
    if os.access(sys.prefix, os.W_OK):
        assert str(root).startswith(sys.prefix)
    assert os.environ.get("TORCH_EXTENSIONS_DIR", str(root)) == str(root)




# A rank's child that SIGTERM does not end (a loader worker hung in fork keeps the rank's preemption handler):
# the process must still exit, and the loader's shutdown must not leave it behind.
_STUBBORN = """
import multiprocessing, signal, sys, time
sys.path.insert(0, {root!r})

def child():
    signal.signal(signal.SIGTERM, lambda *a: None)  # as a forked worker that inherited a flag-setting handler
    time.sleep(600)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=child, daemon=True)
    p.start()
    time.sleep(0.5)
    print(p.pid, flush=True)
    if sys.argv[1] == "reap":
        from mcit.data.loader import reap
        p.terminate()
        p.join(timeout=1)
        assert p.is_alive()  # what torch's shutdown leaves
        reap([p])
        print("reaped" if not p.is_alive() else "alive", flush=True)
    from mcit.core.distributed import exit_process
    exit_process(0)
"""


@pytest.mark.parametrize("how", ["exit", "reap"])
def test_a_child_that_ignores_sigterm_neither_outlives_the_loader_nor_holds_the_exit(tmp_path, how):
    """exit_process ends every child still alive before multiprocessing's exit handler joins them (it joined a
    SIGTERM-proof worker forever: a 2-rank launch that had finished every run never exited); ``reap`` kills
    loader workers that survived torch's shutdown."""
    from pathlib import Path

    script = tmp_path / "stubborn.py"
    script.write_text(_STUBBORN.format(root=str(Path(__file__).resolve().parents[2])))
    t0 = time.time()
    r = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert time.time() - t0 < 30
    lines = r.stdout.split()
    pid = int(lines[0])
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    if how == "reap":
        assert lines[1] == "reaped"
