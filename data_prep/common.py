"""Shared machinery of the dataset converters: resumable, parallel shard writing with a policy for bad
records, and ``--verify``.

A converter lists its records as small picklable specs (a file path and a label, an index into an
array, ...) and gives an ``encode(spec) -> sample dict`` function. Records are cut into shards by
position (shard k holds specs[k*S:(k+1)*S]), so the shard plan is the same on every run:

* each shard is encoded by a worker process, written under a temporary name and renamed;
* ``.progress.json`` (written atomically after each shard) lists the finished shards with their
  sha256, size, sample count and skipped records; a re-run after an interruption keeps every listed
  shard whose file still matches and writes only the missing ones, so no partial shard is ever
  left in place or trusted;
* the manifest (``mcit-shards/1``) is written last, with per-shard sha256 and counts and, under
  ``--on-error skip``, the number and ids of the records that were skipped.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from mcit.data.shards import MANIFEST, DataError, atomic_write_text, open_split, sha256_file

PROGRESS = ".progress.json"


class RecordError(DataError):
    """A bad raw record; ``str()`` names the record id and the file."""

    def __init__(self, record_id: str, file: str | Path, problem: str) -> None:
        super().__init__(f"record {record_id!r} ({file}): {problem}")
        self.record_id = record_id


def _encode_shard(args: tuple[Callable[[Any], dict], Sequence[Any], str, str]) -> tuple[int, list[str], str]:
    """Worker: encode one shard's specs and write it (temporary name + rename)."""
    import webdataset as wds

    encode, specs, path, on_error = args
    skipped: list[str] = []
    tmp = f"{path}.tmp{os.getpid()}"
    n = 0
    try:
        with wds.TarWriter(tmp, mtime=0.0) as sink:
            for spec in specs:
                try:
                    sample = encode(spec)
                except RecordError as e:
                    if on_error == "fail":
                        raise
                    skipped.append(e.record_id)
                    continue
                sink.write(sample)
                n += 1
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return n, skipped, path


def write_shards(directory: Path, specs: Sequence[Any], encode: Callable[[Any], dict], *, shard_size: int,
                 label_space: list[int], class_names: dict[int, str] | None = None,
                 extra: dict[str, Any] | None = None, on_error: str = "fail", workers: int = 1,
                 progress: bool = True, desc: str = "shards") -> dict:
    """Convert ``specs`` into a split directory (see the module docstring). Returns the manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    plan = [list(specs[i:i + shard_size]) for i in range(0, max(len(specs), 1), shard_size)]
    if not specs:
        plan = [[]]
    settings = {"num_specs": len(specs), "shard_size": shard_size, "on_error": on_error}
    prog_path = directory / PROGRESS
    done: dict[str, dict] = {}
    if prog_path.is_file():
        prog = json.loads(prog_path.read_text())
        if prog.get("settings") == settings:
            for name, info in prog["shards"].items():
                f = directory / name
                if f.is_file() and f.stat().st_size == info["bytes"] and sha256_file(f) == info["sha256"]:
                    done[name] = info
    names = [f"shard-{k:06d}.tar" for k in range(len(plan))]
    todo = [(encode, plan[k], str(directory / names[k]), on_error) for k in range(len(plan)) if names[k] not in done]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(plan), initial=len(plan) - len(todo), desc=desc, unit="shard", dynamic_ncols=True)

    def finish(n: int, skipped: list[str], path: str) -> None:
        f = Path(path)
        done[f.name] = {"num_samples": n, "bytes": f.stat().st_size, "sha256": sha256_file(f), "skipped": skipped}
        atomic_write_text(prog_path, json.dumps({"settings": settings, "shards": done}))
        if bar is not None:
            bar.update(1)

    if workers > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for n, skipped, path in pool.map(_encode_shard, todo):
                finish(n, skipped, path)
    else:
        for job in todo:
            finish(*_encode_shard(job))
    if bar is not None:
        bar.close()
    shards = [{"file": nm, "num_samples": done[nm]["num_samples"], "bytes": done[nm]["bytes"],
               "sha256": done[nm]["sha256"]} for nm in names]
    skipped = [r for nm in names for r in done[nm]["skipped"]]
    manifest = {"format": "mcit-shards/1", "num_samples": sum(s["num_samples"] for s in shards),
                "label_space": sorted(int(c) for c in label_space),
                "class_names": {str(k): v for k, v in (class_names or {}).items()}, "shards": shards,
                "skipped": len(skipped), "skipped_records": skipped[:1000], **(extra or {})}
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1))
    prog_path.unlink(missing_ok=True)
    return manifest


def verify(directory: Path, decode: bool = True) -> int:
    """Re-check a split against its manifest (sizes, sha256, and every sample decodes); returns its count."""
    from mcit.data.shards import iter_samples

    split = open_split(directory, "sha256")
    if decode:
        n = sum(1 for _ in iter_samples(split, 0, 1, policy="sample"))
        if n != split.num_samples:
            raise DataError(f"{directory}: {n} samples readable, manifest says {split.num_samples}")
    return split.num_samples


def png_bytes(image: Any) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
