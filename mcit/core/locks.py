"""Waiting for an ``fcntl.flock`` with a time bound.

A kernel lock cannot go stale (it dies with its holder), but a live holder that is stuck would make every
waiter wait forever; each of the project's blocking locks (DeepSpeed's op load, a zoo conversion) waits at most
a stated time and then ends in one line naming the lock file, its holder and what to do.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path


class LockTimeout(RuntimeError):
    """A lock still held after the bound (one line: the file, its holder, what to do)."""


def holder_of(path: Path) -> str:
    """Who holds ``path`` as its holder wrote it (``write_holder``)."""
    try:
        d = json.loads(path.read_text() or "{}")
        return f"pid {d['pid']} on {d['host']} since {time.strftime('%H:%M:%S', time.localtime(d['since']))}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name"


def write_holder(fd: int) -> None:
    """Write this process into the lock file it holds (for the waiters' messages)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode(), 0)


def flock_within(fd: int, path: Path, timeout_s: float, what: str, env: str,
                 say: Callable[[str], None] | None = None) -> None:
    """Take an exclusive flock on ``fd`` (the open ``path``), waiting at most ``timeout_s``; ``what`` says what the
    holder does, ``env`` names the variable that raises the bound. Says once (``say``) that it waits, after 5 s."""
    t0, said = time.monotonic(), False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            write_holder(fd)
            return
        except BlockingIOError:
            waited = time.monotonic() - t0
            if waited >= timeout_s:
                raise LockTimeout(f"lock {path}: still held by {holder_of(path)} after {waited:.0f} s ({what}); if "
                                  f"that process is stuck, stop it (its lock goes with it), or raise {env}") from None
            if say is not None and not said and waited > 5:
                say(f"waiting for {path}, held by {holder_of(path)} ({what}; at most {timeout_s:.0f} s)")
                said = True
            time.sleep(0.2)
