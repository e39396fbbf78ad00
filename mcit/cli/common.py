"""What every command shares: which rank speaks, and how an exception becomes a line and an exit code.

Exit codes: 0 done; 1 the run failed after it started (a write, a rank, a non-finite loss, a data or model
error met while training); 2 bad input found before any work (config, data, backbone, run directory), or a
failure nobody anticipated before the process group existed; 75 preempted (``mcit.core.preemption``: re-run
the same command to resume). Every message is one line from rank 0, except where a rank's own failure is the
news (a data or model error met by that rank); an unanticipated exception also leaves every rank's
traceback in ``<run_dir>/logs/traceback.rank<r>.txt``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable

BAD_INPUT = 2
FAILED = 1


def is_rank0() -> bool:
    """Rank 0 of the launch, read from the launcher's environment (valid before any process group)."""
    return os.environ.get("RANK", "0") == "0"


def say(msg: str) -> None:
    """One line on stderr from rank 0."""
    if is_rank0():
        print(msg, file=sys.stderr)


def fail(msg: str, code: int = BAD_INPUT) -> int:
    """``error: msg`` from rank 0; the exit code."""
    say(f"error: {msg}")
    return code


def input_errors() -> tuple[type[BaseException], ...]:
    """The one-line input errors pre-flight raises (imported here, after the entry point chose the accelerator)."""
    from mcit.core.config import ConfigError
    from mcit.core.rundir import RunDirError
    from mcit.data.shards import DataError
    from mcit.models.base import BackboneError

    return ConfigError, DataError, BackboneError, RunDirError


def unexpected(e: BaseException, run_root: Path | None) -> None:
    """One line on rank 0 for an exception nobody anticipated; every rank's traceback goes to
    ``<run_dir>/logs/traceback.rank<r>.txt`` (a temporary file where there is no usable run directory)."""
    rank = os.environ.get("RANK", "0")
    text = "".join(traceback.format_exception(e))
    where = None
    if run_root is not None:
        try:
            (run_root / "logs").mkdir(parents=True, exist_ok=True)
            where = run_root / "logs" / f"traceback.rank{rank}.txt"
            where.write_text(text)
        except OSError:
            where = None
    if where is None:
        fd, name = tempfile.mkstemp(prefix=f"mcit-traceback-rank{rank}-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        where = Path(name)
    if rank == "0":
        first = (str(e).splitlines() or [""])[0]
        print(f"error: {e.__class__.__name__}: {first} (traceback in {where})", file=sys.stderr)


def before_launch(e: BaseException) -> int:
    """An exception in pre-flight (no process group yet): an input error is its own line, anything else one
    line with the traceback kept; exit 2."""
    if isinstance(e, input_errors()):
        return fail(str(e))
    unexpected(e, None)
    return BAD_INPUT


def after_launch(e: BaseException, run_root: Path | None, *, resume_hint: Callable[[], str] | None = None) -> int:
    """An exception once the ranks run; the exit code. ``resume_hint``: where a failed write leaves the run
    (the task sequence names its last committed stage); a preempted run shuts the process group down here."""
    from mcit.core import distributed as dist
    from mcit.core import preemption
    from mcit.core.checkpoint import WriteError
    from mcit.core.locks import LockTimeout
    from mcit.data.shards import DataError
    from mcit.models.base import BackboneError
    from mcit.run.engine import NonFiniteError
    from mcit.run.pipeline import CollectiveError

    if isinstance(e, preemption.Preempted):
        if dist.is_main():
            print(f"preempted at {e}; resume with the same command (exit code {preemption.RESUME_EXIT_CODE})",
                  file=sys.stderr)
        dist.shutdown()
        return preemption.RESUME_EXIT_CODE
    if isinstance(e, (DataError, BackboneError, CollectiveError, LockTimeout)):  # this rank's own failure: it says so
        print(f"error (rank {dist.rank()}): {e}", file=sys.stderr)
        return FAILED
    if isinstance(e, NonFiniteError):  # every rank agreed on it: one line
        if dist.is_main():
            print(f"error: {e}", file=sys.stderr)
        return FAILED
    if isinstance(e, WriteError):  # rank 0's files, or one rank's step checkpoint: the ranks agreed to stop
        print(f"error: {e}" + (f"; {resume_hint()}" if resume_hint else ""), file=sys.stderr)
        return FAILED
    if isinstance(e, dist.PeerFailed):  # the rank that failed says why
        return FAILED
    unexpected(e, run_root)  # e.g. a method's own check: one line from rank 0, not a traceback per rank
    return FAILED


def quietly(main: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """Run a rank program with what the libraries print on the way sent to its rank log (mcit.core.console)."""
    from mcit.core import console

    with console.quiet():
        return main(argv)


def script(main: Callable[[list[str] | None], int]) -> None:
    """The end of a ``pipelines/`` shim: run ``main`` and exit every rank with its code (``exit_process``)."""
    from mcit.core.distributed import exit_process

    exit_process(main(None))
