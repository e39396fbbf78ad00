"""Atomic file writes and method-state files (safetensors, with a JSON description beside them)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from mcit.data.shards import atomic_write_bytes, atomic_write_text

__all__ = ["atomic_write_bytes", "atomic_write_text", "publish_dir", "save_state", "load_state", "write_json",
           "read_json"]


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


def publish_dir(tmp: Path, out: Path, *, replace: bool = True) -> bool:
    """Move the finished directory ``tmp`` to ``out`` by one rename, so a killed writer leaves only
    ``tmp``, never a half-written ``out``. An existing ``out`` is replaced, or with ``replace=False``
    kept (another process published it first) and ``tmp`` dropped; returns whether ``tmp`` was moved."""
    import shutil

    if out.exists():
        if not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return True
