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

    MCIT_TEST_EVAL_KILL=trained:task:chunks  SIGKILLs each rank right after it committed its ``chunks``-th chunk of
    answers to the evaluation cell of task ``task`` after ``trained`` tasks (0: the zero-shot row), through
    ``mcit.run.cells.on_chunk``: a pass killed in the middle of a task's test split.

    MCIT_TEST_STARTUP_PAUSE=moment:marker  stops every rank at a start-up moment for 300 s, after writing
    ``marker.<rank>``, so a test can SIGKILL the launch there: ``preflight`` (checked, nothing written),
    ``ops_locked`` (inside mcit's extension lock with torch's own build lock taken, as torch takes it to build
    or check an op: ``torch.utils.file_baton``), ``process_group`` (the group up, DeepSpeed's set-up not done),
    ``run_locked`` (the run directory locked, its config not written yet). Through ``mcit.core.distributed.
    on_startup`` and ``mcit.core.extensions.while_locked``.
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


def install_startup_pause(spec: str) -> None:
    import time

    moment, marker = spec.split(":", 1)

    def stop(rank: str) -> None:
        Path(f"{marker}.{rank}").write_text(str(os.getpid()))
        time.sleep(300)

    if moment == "ops_locked":
        from torch.utils.file_baton import FileBaton

        from mcit.core.extensions import while_locked

        def inside(root: Path) -> None:  # torch's own lock, taken as _jit_compile takes it
            (root / "deepspeed_shm_comm").mkdir(parents=True, exist_ok=True)
            assert FileBaton(str(root / "deepspeed_shm_comm" / "lock")).try_acquire()
            stop(os.environ.get("RANK", "0"))

        while_locked.append(inside)
    else:
        from mcit.core.distributed import on_startup

        on_startup.append(lambda name: stop(os.environ.get("RANK", "0")) if name == moment else None)


def install_eval_kill(spec: str) -> None:
    trained, task, chunks = (int(x) for x in spec.split(":"))

    from mcit.run.cells import on_chunk

    @on_chunk
    def kill(cell: object, writer: str, seq: int) -> None:
        key = getattr(cell, "key", {})
        if (key.get("trained"), key.get("task")) == (trained, task) and seq + 1 >= chunks:
            os.kill(os.getpid(), signal.SIGKILL)


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
    if os.environ.get("MCIT_TEST_STARTUP_PAUSE"):
        install_startup_pause(os.environ["MCIT_TEST_STARTUP_PAUSE"])
    if os.environ.get("MCIT_TEST_PAUSE"):
        install_pause(os.environ["MCIT_TEST_PAUSE"])
    if os.environ.get("MCIT_TEST_FAULT"):
        install(os.environ["MCIT_TEST_FAULT"])
    if os.environ.get("MCIT_TEST_EVAL_KILL"):
        install_eval_kill(os.environ["MCIT_TEST_EVAL_KILL"])
    if os.environ.get("MCIT_TEST_NONFINITE"):
        install_nonfinite(os.environ["MCIT_TEST_NONFINITE"])
    from mcit.cli.run import main
    from mcit.core.distributed import exit_process

    exit_process(main())  # as pipelines/run_task_sequence.py ends
