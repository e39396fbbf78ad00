"""What a run prints: its own lines, rank 0's progress bars and the tables.

What the libraries say on the way (Python warnings raised inside torch, transformers, DeepSpeed, ...,
their log records, DeepSpeed's "op built successfully" prints) is not for the console of a run that is
working: it goes to ``<run_dir>/logs/rank<r>.log``, kept in memory from the start of the process until
the run directory is known (``log_to``). Warnings raised by this project's own code still print.
"""

from __future__ import annotations

import contextlib
import io
import logging
import logging.handlers
import sys
import warnings
from pathlib import Path
from typing import Iterator

_OWN = (str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2] / "pipelines"))
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_state: dict[str, object] = {}


def _show(message, category, filename, lineno, file=None, line=None) -> None:  # warnings' signature
    if str(Path(filename).resolve()).startswith(_OWN):
        _state["showwarning"](message, category, filename, lineno, file, line)  # type: ignore[operator]
        return
    logging.getLogger("py.warnings").warning("%s:%s: %s: %s", filename, lineno, category.__name__, message)


def reroute(name: str) -> None:
    """A library logger with its own console handler (DeepSpeed's, MLflow's) hands its records to the root
    instead: to the rank log."""
    lg = logging.getLogger(name)
    for h in list(lg.handlers):
        lg.removeHandler(h)
    lg.propagate = True


def quiet_libraries() -> None:
    """From now on library warnings and log records are kept for the rank log, not printed (idempotent)."""
    if "buffer" in _state:
        return
    buffer = logging.handlers.MemoryHandler(capacity=1_000_000, flushLevel=logging.CRITICAL + 10)
    root = logging.getLogger()
    root.addHandler(buffer)
    _state["root_level"] = root.level
    root.setLevel(logging.INFO)
    _state["buffer"] = buffer
    _state["showwarning"] = warnings.showwarning
    warnings.showwarning = _show
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()
    reroute("DeepSpeed")


def log_to(path: Path) -> Path:
    """Write what was kept so far, and everything after, to ``path`` (appended: a resumed run's earlier
    lines stay). Called again (another run in the same process), the log moves to the new ``path``.
    Returns ``path``."""
    quiet_libraries()
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT))
    current = _state["buffer"]
    if isinstance(current, logging.handlers.MemoryHandler):
        current.setTarget(handler)
        current.flush()
    root = logging.getLogger()
    root.removeHandler(current)  # type: ignore[arg-type]
    current.close()  # type: ignore[union-attr]
    root.addHandler(handler)
    _state["buffer"] = handler  # quiet_libraries stays done
    reroute("DeepSpeed")  # created when deepspeed was first imported, possibly after quiet_libraries
    return path


@contextlib.contextmanager
def stdout_to_log(name: str) -> Iterator[None]:
    """Lines a library prints to stdout inside the block (DeepSpeed's op builds at start-up) become log
    records of logger ``name``."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            yield
        finally:
            for line in buf.getvalue().splitlines():
                if line.strip():
                    logging.getLogger(name).info(line)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """``quiet_libraries`` for the body of an entry point, undone after it (entry points also run
    in-process, from tests)."""
    quiet_libraries()
    try:
        yield
    finally:
        restore()


def restore() -> None:
    """Undo ``quiet_libraries`` (tests that run the entry point in-process)."""
    if "buffer" not in _state:
        return
    root = logging.getLogger()
    handler = _state.pop("buffer")
    root.removeHandler(handler)  # type: ignore[arg-type]
    handler.close()  # type: ignore[union-attr]
    root.setLevel(_state.pop("root_level"))  # type: ignore[arg-type]
    warnings.showwarning = _state.pop("showwarning")  # type: ignore[assignment]
    if sys.stderr is not None:
        from transformers.utils import logging as hf_logging

        hf_logging.enable_default_handler()
        hf_logging.disable_propagation()
