"""Preemption: stop at the next optimizer step with a committed checkpoint, and say "resume me".

Two ways to ask, because a cluster delivers the warning in two ways:

* a signal (SIGUSR1 or SIGTERM) to any rank process: Slurm's ``--signal=USR1@T`` on the job steps,
  or the time limit's SIGTERM;
* the file ``<run_dir>/PREEMPT`` (``RunDir.preempt_request``): the job scripts' trap writes it when the
  *batch shell* gets the signal (``--signal=B:USR1@T``, ``scancel --signal=USR1 --batch``). Launchers such as
  DeepSpeed's kill their children on SIGTERM instead of passing it on, and on several nodes only the batch
  node's shell is signalled, so a file on the shared run directory reaches every rank the same way.

One rank noticing is enough: ``agreed()`` all-reduces the request once per optimizer step (and
between stages), so every rank stops at the same step, the step checkpoint is written by all of
them, and every rank exits with ``RESUME_EXIT_CODE`` (75, EX_TEMPFAIL). Re-running the same command
resumes from that checkpoint; the Slurm scripts requeue themselves on that code.
"""

from __future__ import annotations

import signal
from pathlib import Path

RESUME_EXIT_CODE = 75

_requested: str | None = None


class Preempted(Exception):
    """Raised on every rank once the request is agreed and the checkpoint is committed."""


def _handler(signum: int, frame: object) -> None:
    global _requested
    _requested = signal.Signals(signum).name


def install() -> None:
    """Catch SIGUSR1 and SIGTERM (main thread only; called by the entry points)."""
    for s in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(s, _handler)


def clear(request_file: Path) -> None:
    """Forget a request that a previous (now resumed) job left behind."""
    global _requested
    _requested = None
    request_file.unlink(missing_ok=True)


def local_request(request_file: Path | None) -> str | None:
    """This rank's request: the signal's name, or the request file's, or None."""
    if _requested:
        return _requested
    if request_file is not None and request_file.exists():
        return request_file.name
    return None


def agreed(request_file: Path | None) -> bool:
    """True on every rank iff some rank has a request (one small all-reduce)."""
    from mcit.core import distributed as dist

    return not dist.all_ok(local_request(request_file) is None)
