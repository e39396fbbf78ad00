#!/usr/bin/env python
"""The task-sequence entry point with a fault injected at an exact optimizer step (tests only).

    MCIT_TEST_FAULT=task:step[:rank[:SIGNAL]] python tests/launch/workers/faulty_run.py --config C ...

Right after optimizer step ``step`` of task ``task``, sends SIGNAL (default KILL) to every rank (after a
barrier, so all of them reach the step) or only to ``rank`` (``*`` = every rank). The fault goes in through
``mcit.run.engine.on_optimizer_step``; the production entry point reads no such variable.

    MCIT_TEST_NONFINITE=task:step[:rank[:nan|inf]] python tests/launch/workers/faulty_run.py --config C ...

makes the loss of optimizer step ``step`` of task ``task`` NaN (or inf) on every rank or on ``rank`` alone,
once (the first micro-batch of that step), through the test-only seam ``mcit.run.engine.on_loss``.

    MCIT_TEST_WRITE_FAIL=relative/path[:ERRNO]  makes the first write of a file whose path ends with
    ``relative/path`` fail with OSError(ERRNO) (default ENOSPC), through ``mcit.core.checkpoint.on_write``.

    MCIT_TEST_PAUSE=task:step:seconds[:release_file]  sleeps on every rank after that optimizer step (a slow
    run, results unchanged), at most ``seconds``, ending early once ``release_file`` exists.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def install(spec: str) -> None:
    parts = spec.split(":")
    task, step = int(parts[0]), int(parts[1])
    who = int(parts[2]) if len(parts) > 2 and parts[2] != "*" else None
    sig = signal.Signals[f"SIG{parts[3]}"] if len(parts) > 3 else signal.SIGKILL

    from mcit.core import distributed as dist
    from mcit.run.engine import on_optimizer_step

    @on_optimizer_step
    def fault(t: int, gstep: int, engine: object) -> None:
        if (t, gstep) != (task, step) or who not in (None, dist.rank()):
            return
        if who is None:
            dist.barrier()
        os.kill(os.getpid(), sig)


def install_nonfinite(spec: str) -> None:
    parts = spec.split(":")
    task, step = int(parts[0]), int(parts[1])
    who = int(parts[2]) if len(parts) > 2 and parts[2] != "*" else None
    value = float(parts[3]) if len(parts) > 3 else float("nan")

    from mcit.core import distributed as dist
    from mcit.run.engine import on_loss

    fired = []

    @on_loss
    def poison(t: int, gstep: int, loss):
        if (t, gstep) == (task, step) and not fired:
            fired.append(True)  # on every rank, so all ranks count the same micro-batch
            if who in (None, dist.rank()):
                return loss * value
        return loss


def install_pause(spec: str) -> None:
    task, step, seconds, *release = spec.split(":", 3)
    import time

    from mcit.run.engine import on_optimizer_step

    @on_optimizer_step
    def pause(t: int, gstep: int, engine: object) -> None:
        if (t, gstep) == (int(task), int(step)):
            end = time.time() + float(seconds)
            while time.time() < end and not (release and Path(release[0]).exists()):
                time.sleep(0.2)


def install_write_fail(spec: str) -> None:
    import errno

    suffix, _, name = spec.partition(":")
    code = getattr(errno, name or "ENOSPC")

    from mcit.core.checkpoint import on_write

    fired = []

    @on_write
    def fail(path: Path) -> None:
        if not fired and path.as_posix().endswith(suffix):
            fired.append(True)
            raise OSError(code, os.strerror(code))


if __name__ == "__main__":
    if os.environ.get("MCIT_TEST_WRITE_FAIL"):
        install_write_fail(os.environ["MCIT_TEST_WRITE_FAIL"])
    if os.environ.get("MCIT_TEST_PAUSE"):
        install_pause(os.environ["MCIT_TEST_PAUSE"])
    if os.environ.get("MCIT_TEST_FAULT"):
        install(os.environ["MCIT_TEST_FAULT"])
    if os.environ.get("MCIT_TEST_NONFINITE"):
        install_nonfinite(os.environ["MCIT_TEST_NONFINITE"])
    from mcit.cli.run import main
    from mcit.core.distributed import exit_process

    exit_process(main())  # as pipelines/run_task_sequence.py ends
