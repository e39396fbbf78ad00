"""CIFAR-100 (the "python version": cifar-100-python/{train,test,meta} pickles) -> class-incremental shards.

    python -m data_prep.cifar100 --raw /data/cifar-100-python --out data/shards/cifar100 \
        --classes-per-task 10 --seed 1993 [--workers 4] [--on-error fail|skip]
    python -m data_prep.cifar100 --verify data/shards/cifar100

The class order is ``numpy.random.RandomState(seed).permutation(num_classes)`` (seed 1993 gives the
order iCaRL-derived code bases use) and is recorded in every manifest and in ``benchmark.json``.
Task t holds classes order[t*C:(t+1)*C]; ``<out>/task<t>/{train,test}`` are split directories.
Re-running after an interruption finishes only the missing shards (see data_prep.common).
"""

from __future__ import annotations

import pickle
from functools import partial
from pathlib import Path

import numpy as np

from data_prep.common import RecordError, build_cil, check_unique, cil_arguments, cil_summary, png_bytes, run_cli
from mcit.data.shards import DataError


def load_pickle(path: Path) -> dict:
    if not path.is_file():
        raise DataError(f"missing file: {path} (expected the cifar-100-python layout: train, test, meta)")
    try:
        with open(path, "rb") as f:
            data = pickle.load(f, encoding="bytes")
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path}: not a CIFAR python pickle ({e.__class__.__name__}: {e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: unknown format (expected a dict of arrays)")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in data.items()}


def encode(spec: tuple[str, str, int, str, bytes, int], num_classes: int) -> dict:
    """One record (key, source, label, id, 3072 bytes, index) -> a webdataset sample (PNG, class, json)."""
    from PIL import Image

    key, source, label, rid, raw, index = spec
    if not 0 <= label < num_classes:
        raise RecordError(rid, source, f"label {label} outside 0..{num_classes - 1}")
    if len(raw) != 3 * 32 * 32:
        raise RecordError(rid, source, f"image has {len(raw)} bytes, expected 3072 (3x32x32)")
    arr = np.frombuffer(raw, dtype=np.uint8).reshape(3, 32, 32).transpose(1, 2, 0)
    return {"__key__": key, "png": png_bytes(Image.fromarray(arr, mode="RGB")), "cls": label,
            "json": {"id": rid, "index": index, "label": label}}


def records(data: dict, split: str, source: Path, num_classes: int = 100, on_error: str = "fail"
            ) -> tuple[list[tuple[str, str, int, str, bytes, int]], list[str]]:
    """The split's records and the ids skipped under ``on_error=skip`` (bad label, duplicate id)."""
    for k in ("data", "fine_labels"):
        if k not in data:
            raise DataError(f"{source}: unknown format (no {k!r} entry)")
    arr = np.asarray(data["data"])
    labels = [int(x) for x in data["fine_labels"]]
    if len(arr) != len(labels):
        raise DataError(f"{source}: {len(arr)} images but {len(labels)} labels")
    names = data.get("filenames")
    ids = [names[i].decode() if names is not None and isinstance(names[i], bytes) else f"{split}_{i:06d}"
           for i in range(len(labels))]
    dup = check_unique(ids, source, on_error)
    out, skipped = [], [ids[i] for i in sorted(dup)]
    for i, (row, lab) in enumerate(zip(arr, labels)):
        if i in dup:
            continue
        if not 0 <= lab < num_classes:
            if on_error == "fail":
                raise RecordError(ids[i], source, f"label {lab} outside 0..{num_classes - 1}")
            skipped.append(ids[i])
            continue
        out.append((f"{split}_{i:06d}", str(source), lab, ids[i], np.asarray(row, dtype=np.uint8).tobytes(), i))
    return out, skipped


def build(raw: Path, out: Path, *, classes_per_task: int = 10, seed: int = 1993, shard_size: int = 1000,
          workers: int = 1, on_error: str = "fail", progress: bool = True) -> dict:
    meta = load_pickle(raw / "meta")
    listed = meta.get("fine_label_names")
    if not isinstance(listed, (list, tuple)) or not listed:
        raise DataError(f"{raw / 'meta'}: unknown format (no 'fine_label_names' list of class names)")
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in listed]
    pickles = {s: load_pickle(raw / s) for s in ("train", "test")}
    for s, data in pickles.items():  # every file's keys before any count is compared
        for k in ("data", "fine_labels"):
            if k not in data:
                raise DataError(f"{raw / s}: unknown format (no {k!r} entry)")
    if classes_per_task < 1 or len(names) % classes_per_task:
        raise DataError(f"--classes-per-task {classes_per_task} does not divide {len(names)} classes "
                        f"(the {len(names)} fine_label_names of {raw / 'meta'})")
    splits, skipped = {}, {}
    for s in ("train", "test"):
        splits[s], skipped[s] = records(pickles[s], s, raw / s, len(names), on_error)
    return build_cil(out, splits, names, benchmark="cifar100", classes_per_task=classes_per_task, seed=seed,
                     encode=partial(encode, num_classes=len(names)), source_skipped=skipped, shard_size=shard_size,
                     workers=workers, on_error=on_error, progress=progress, extra={"raw_format": "cifar-100-python"})


def main(argv: list[str] | None = None) -> int:
    ap = cil_arguments(__doc__, raw_help="the cifar-100-python directory", classes_per_task=10, seed=1993,
                       out="data/shards/cifar100")
    return run_cli(ap, argv, lambda a: build(a.raw, a.out, classes_per_task=a.classes_per_task, seed=a.seed,
                                             shard_size=a.shard_size, workers=a.workers, on_error=a.on_error,
                                             progress=not a.no_progress), cil_summary("cifar100"))


if __name__ == "__main__":
    raise SystemExit(main())
