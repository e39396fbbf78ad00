"""Atomic writes: files (temp file + rename), whole directories (one rename), method states (safetensors)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch



def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``path`` as a temp file beside it, fsync, rename: readers see the old or the new file, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def save_state(path: Path, state: dict[str, torch.Tensor], meta: dict[str, Any] | None = None) -> None:
    """Write a method state dict as safetensors (temp file + rename)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(tensors, str(tmp), metadata={"mcit": json.dumps(meta or {})})
    os.replace(tmp, path)


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
