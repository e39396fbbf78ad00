"""Atomic writes: files (temp file + rename), whole directories (one rename), method states (safetensors).

Every file write goes through ``_atomic``: a failure (full disk, read-only or forbidden directory) leaves
the old file as it was, removes the temp file and raises :class:`WriteError`, which names the file the run
meant to write (not the temp file), so the one line a user sees says what could not be written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_write_hooks: list[Callable[[Path], None]] = []


class WriteError(OSError):
    """A file could not be written; ``path`` is the file meant, the message its one-line cause."""

    def __init__(self, path: Path, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.path = path

    def __str__(self) -> str:
        import errno

        code = f" ({errno.errorcode[self.errno]})" if self.errno in errno.errorcode else ""
        return f"cannot write {self.path}: {self.strerror}{code}"


def on_write(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    """Test-only seam: ``fn(path)`` runs after each temp file is written and before it replaces ``path``;
    raising an OSError there is a write that failed (tests inject ENOSPC this way). Returns ``fn``."""
    _write_hooks.append(fn)
    return fn


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` to a temp file beside ``path``, then rename it over ``path``; readers see the old or
    the new file, never a part, and a failure leaves no temp file behind."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        for hook in _write_hooks:
            hook(path)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise (e if isinstance(e, WriteError) else WriteError(path, e)) from e


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``path`` atomically (temp file, fsync, rename)."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    _atomic(path, write)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def save_state(path: Path, state: dict[str, torch.Tensor], meta: dict[str, Any] | None = None) -> None:
    """Write a method state dict as safetensors (temp file + rename)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    _atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata={"mcit": json.dumps(meta or {})}))


def load_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1))


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def staging_dir(out: Path) -> Path:
    """A fresh, empty ``<out>.partial`` beside ``out``: build a directory there, then ``publish_dir`` it."""
    import shutil

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish_dir(tmp: Path, out: Path, *, replace: bool = True, files: dict[str, str] | None = None) -> bool:
    """Move the finished directory ``tmp`` to ``out`` by one rename, so a killed writer leaves only
    ``tmp``, never a half-written ``out``. ``files`` (name -> text) are written into ``tmp`` first (a
    build's record, e.g. its settings: present exactly when everything else is). An existing ``out`` is
    replaced, or with ``replace=False`` kept (another process published it first) and ``tmp`` dropped;
    returns whether ``tmp`` was moved."""
    import shutil

    for name, text in (files or {}).items():
        (tmp / name).write_text(text)
    if out.exists():
        if not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return True
