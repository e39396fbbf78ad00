"""Progress: tqdm's bar on a terminal, plain lines anywhere else.

A Slurm job's output (``slurm-<id>.out``), a file or a pipe is not a terminal: tqdm's carriage-return redraws
leave "0%" and a blank line there, which tells a cluster user nothing. Off a terminal each bar prints a line when
it starts, one every ``MCIT_PROGRESS_INTERVAL_S`` seconds (default 30) and one when it closes, each in tqdm's
own words (``tqdm.format_meter``): what, how far, rate, elapsed and remaining time, and the postfix (the loss).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

LINE = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class LineProgress:
    """tqdm's ``update`` / ``set_postfix`` / ``close`` printing whole lines at an interval."""

    def __init__(self, total: int, desc: str, unit: str, initial: int = 0, interval_s: float | None = None,
                 file: TextIO | None = None) -> None:
        self.total, self.desc, self.unit, self.n, self.initial = total, desc, unit, initial, initial
        self.interval = float(os.environ.get("MCIT_PROGRESS_INTERVAL_S", 30) if interval_s is None else interval_s)
        self.file = file or sys.stderr
        self.postfix: dict[str, Any] = {}
        self.t0 = self.last = time.monotonic()
        self.closed = False
        self._print()

    def _print(self) -> None:
        from tqdm import tqdm

        elapsed = time.monotonic() - self.t0
        rate = (self.n - self.initial) / elapsed if elapsed > 0 and self.n > self.initial else None
        post = ", ".join(f"{k}={v}" for k, v in self.postfix.items())
        text = tqdm.format_meter(self.n, self.total, elapsed, prefix=self.desc, unit=self.unit, rate=rate,
                                 postfix=post or None, bar_format=LINE, initial=self.initial)
        print(text, file=self.file, flush=True)
        self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.interval:
            self._print()

    def set_postfix(self, refresh: bool = True, **kw: Any) -> None:
        self.postfix = kw

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._print()


def progress_bar(total: int, desc: str, unit: str, initial: int = 0, leave: bool = False) -> Any:
    """A tqdm bar where stderr is a terminal, else a ``LineProgress``; both take update / set_postfix / close."""
    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, leave=leave,
                    mininterval=0.5)
    return LineProgress(total, desc, unit, initial)
