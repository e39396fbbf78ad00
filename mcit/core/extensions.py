"""DeepSpeed's JIT-built C++ ops (the CPU shared-memory all-reduce, CPU Adam, the fused optimizers), built at
install time and loaded at run time under a lock the kernel releases when its holder dies.

Why: torch builds or checks an extension under ``<TORCH_EXTENSIONS_DIR>/<op>/lock`` (``torch.utils.file_baton``)
and every other process waits on that file with no time limit. The window opens at every start, not only the
first build (torch takes the file to check that the build is current), so a process killed inside it -- a node
lost, a job cancelled during start-up -- left a file that hung every later run of every user of that directory
(pytorch/pytorch#189245). Here every op a run needs is loaded before DeepSpeed asks for it (DeepSpeed's
``OpBuilder.load`` then returns the loaded module), inside an ``fcntl.flock`` on ``<dir>/mcit.flock``: while
mcit holds it no other mcit process is inside torch's window, so a ``lock`` file found under it was left by a
killed process and is removed, naming it. A wait for a live holder is bounded
(``MCIT_EXTENSION_LOCK_TIMEOUT_S``, default 1800 s: a first build of CPU Adam takes about a minute) and ends in
one line naming the lock file and its holder.

A process outside mcit that builds into the same directory does not take mcit's lock: keep
``TORCH_EXTENSIONS_DIR`` to mcit's (the default, inside the environment) for that reason.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mcit.core.locks import flock_within

LOCK_FILE = "mcit.flock"
# Test seam: functions called with the extensions root while the lock is held, before the ops load (a test holds
# a launch there to kill it inside the window; tests/launch/workers/faulty_run.py). The entry points add none.
while_locked: list[Callable[[Path], None]] = []


def extensions_root() -> Path:
    """The directory torch builds extensions in: ``TORCH_EXTENSIONS_DIR``, set to this environment's own
    ``<sys.prefix>/torch_extensions`` where the variable is unset and the prefix writable (a shared
    ``~/.cache/torch_extensions`` spreads one checkout's builds and locks to every other)."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ and os.access(sys.prefix, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))


def _say(text: str) -> None:
    print(f"mcit: {text}", file=sys.stderr, flush=True)


def clear_torch_locks(root: Path, say: Callable[[str], None] = _say) -> list[Path]:
    """Remove torch's build locks under ``root`` (``<op>/lock``, ``<py>/<op>/lock``). Only call it holding
    ``extension_lock``: then no mcit process is inside torch's window, and a lock there was left by a dead one."""
    removed = []
    for lock in sorted({*root.glob("*/lock"), *root.glob("*/*/lock")}):
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        removed.append(lock)
        say(f"removed the extension build lock {lock}, left by a process killed while it built or checked the "
            f"op (no live process held {root / LOCK_FILE})")
    return removed


@contextmanager
def extension_lock(root: Path | None = None, timeout_s: float | None = None,
                   say: Callable[[str], None] = _say) -> Iterator[Path]:
    """Hold ``<root>/mcit.flock`` (waiting at most ``timeout_s``), clear torch's locks left by killed processes,
    and yield the root. The kernel drops the lock when the process dies, however it dies."""
    root = extensions_root() if root is None else root
    timeout = float(os.environ.get("MCIT_EXTENSION_LOCK_TIMEOUT_S", 1800) if timeout_s is None else timeout_s)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        flock_within(fd, path, timeout, "loading DeepSpeed's ops", "MCIT_EXTENSION_LOCK_TIMEOUT_S", say)
        clear_torch_locks(root, say)
        for hook in while_locked:
            hook(root)
        yield root
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def ops_for(ds_config: dict[str, Any] | None) -> list[str]:
    """The DeepSpeed op builders a run loads: the CPU shared-memory all-reduce (``init_distributed`` on the CPU
    accelerator) and, where the DeepSpeed JSON names an Adam optimizer, CPU Adam under ZeRO-offload or the fused
    Adam otherwise (DeepSpeed's ``_configure_basic_optimizer``; ``torch_adam: true`` needs none)."""
    names = ["ShareMemCommBuilder"]
    opt = (ds_config or {}).get("optimizer")
    if opt and str(opt.get("type", "")).lower() in ("adam", "adamw"):
        offload = ((ds_config or {}).get("zero_optimization", {}).get("offload_optimizer") or {}).get("device")
        if offload in ("cpu", "nvme"):
            names.append("CPUAdamBuilder")
        elif not (opt.get("params") or {}).get("torch_adam"):
            names.append("FusedAdamBuilder")
    return names


def _builder(name: str) -> Any:
    """The accelerator's builder ``name`` where this platform can build it, else None."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(name)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def loaded_ops() -> set[str]:
    """The ops loaded in this process (DeepSpeed's cache)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    return set(OpBuilder._loaded_ops)


def load_ops(names: list[str], timeout_s: float | None = None) -> list[str]:
    """Load the builders ``names`` (those this platform can build) under ``extension_lock``; the op names loaded.
    A no-op for ops this process has loaded already (no lock taken)."""
    builders = [b for b in map(_builder, names) if b is not None]
    todo = [b for b in builders if b.name not in loaded_ops()]
    if todo:
        from mcit.core.console import stdout_to_log

        with extension_lock(timeout_s=timeout_s), stdout_to_log("deepspeed"):  # its builds print on stdout
            for b in todo:
                b.load()
    return [b.name for b in builders]


def main(argv: list[str] | None = None) -> int:
    """``python -m mcit.core.extensions``: build the ops a run can need now (``make install`` does), and say which."""
    import argparse

    ap = argparse.ArgumentParser(description="Build DeepSpeed's JIT ops into TORCH_EXTENSIONS_DIR ahead of the runs.")
    ap.add_argument("--ops", nargs="+", default=None, metavar="BUILDER",
                    help="only these op builders (e.g. ShareMemCommBuilder: `make install`, which the demo's runs "
                         "need; `make install-test` adds CPUAdamBuilder); default: every op a run can need here")
    args = ap.parse_args(argv)
    from mcit.core.distributed import default_accelerator

    default_accelerator()
    import torch

    root = extensions_root()
    # the all-reduce of every CPU run, CPU Adam of ZeRO-offload; the fused Adam where a GPU runs it (on CPUs only a
    # DeepSpeed JSON that names Adam without offload wants it: built then, under the lock, in about 90 s). An op
    # not built here is built by the first run that needs it, under the lock (CPU Adam: about 40 s on 2 cores).
    names = args.ops or ["ShareMemCommBuilder", "CPUAdamBuilder",
                         *(["FusedAdamBuilder"] if torch.cuda.is_available() else [])]
    built, failed, skipped = [], [], []
    for name in names:
        t0 = time.time()
        try:
            builder = _builder(name)
            if builder is None:
                skipped.append(name)
                continue
            with extension_lock(root):
                builder.load()
            built.append(f"{builder.name} ({time.time() - t0:.0f} s)")
        except Exception as e:  # noqa: BLE001 - one op that cannot build here is reported, the others still built
            failed.append(f"{name} ({e.__class__.__name__}: {(str(e).splitlines() or [''])[0][:160]})")
    line = f"mcit: DeepSpeed ops in {root}: built {', '.join(built) or 'none'}"
    if failed:
        line += f"; not built (a run that needs one builds it then, under the lock): {', '.join(failed)}"
    if skipped:
        line += f"; not for this platform: {', '.join(skipped)}"
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
