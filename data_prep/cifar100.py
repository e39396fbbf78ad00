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

import argparse
import json
import pickle
import sys
from functools import partial
from pathlib import Path

import numpy as np

from data_prep.common import RecordError, png_bytes, verify, write_shards
from mcit.data.shards import DataError, atomic_write_text


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


def encode(spec: tuple[str, int, bytes, int, str], num_classes: int) -> dict:
    """One record -> a webdataset sample (PNG, class, json)."""
    from PIL import Image

    key, label, raw, index, source = spec
    if not 0 <= label < num_classes:
        raise RecordError(key, source, f"label {label} outside 0..{num_classes - 1}")
    if len(raw) != 3 * 32 * 32:
        raise RecordError(key, source, f"image has {len(raw)} bytes, expected 3072 (3x32x32)")
    arr = np.frombuffer(raw, dtype=np.uint8).reshape(3, 32, 32).transpose(1, 2, 0)
    return {"__key__": key, "png": png_bytes(Image.fromarray(arr, mode="RGB")), "cls": label,
            "json": {"index": index, "label": label}}


def records(data: dict, split: str, source: Path, num_classes: int = 100, on_error: str = "fail"
            ) -> tuple[list[tuple[str, int, bytes, int, str]], list[str]]:
    """The split's records and the ids skipped under ``on_error=skip`` (bad label, duplicate id)."""
    for k in ("data", "fine_labels"):
        if k not in data:
            raise DataError(f"{source}: unknown format (no {k!r} entry)")
    arr = np.asarray(data["data"])
    labels = [int(x) for x in data["fine_labels"]]
    if len(arr) != len(labels):
        raise DataError(f"{source}: {len(arr)} images but {len(labels)} labels")
    names = data.get("filenames")
    out, seen, skipped = [], set(), []
    for i, (row, lab) in enumerate(zip(arr, labels)):
        key = f"{split}_{i:06d}"
        rid = names[i].decode() if names is not None and isinstance(names[i], bytes) else key
        try:
            if rid in seen:
                raise RecordError(rid, source, "duplicate id")
            if not 0 <= lab < num_classes:
                raise RecordError(rid, source, f"label {lab} outside 0..{num_classes - 1}")
        except RecordError:
            if on_error == "fail":
                raise
            skipped.append(rid)
            continue
        seen.add(rid)
        out.append((key, lab, np.asarray(row, dtype=np.uint8).tobytes(), i, str(source)))
    return out, skipped


def build(raw: Path, out: Path, *, classes_per_task: int = 10, seed: int = 1993, shard_size: int = 1000,
          workers: int = 1, on_error: str = "fail", progress: bool = True) -> dict:
    meta = load_pickle(raw / "meta")
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in meta.get("fine_label_names", [])]
    if not names:
        raise DataError(f"{raw / 'meta'}: unknown format (no fine_label_names)")
    C = len(names)
    if C % classes_per_task:
        raise DataError(f"--classes-per-task {classes_per_task} does not divide {C} classes")
    order = [int(c) for c in np.random.RandomState(seed).permutation(C)]
    splits, source_skipped = {}, {}
    for s in ("train", "test"):
        splits[s], source_skipped[s] = records(load_pickle(raw / s), s, raw / s, C, on_error)
    tasks = []
    for t in range(C // classes_per_task):
        classes = order[t * classes_per_task:(t + 1) * classes_per_task]
        for s, recs in splits.items():
            chosen = [r for r in recs if r[1] in set(classes)]
            write_shards(out / f"task{t}" / s, chosen, partial(encode, num_classes=C), shard_size=shard_size,
                         label_space=classes, class_names={c: names[c] for c in classes},
                         extra={"task": f"task{t}", "class_order": order, "seed": seed, "source": "cifar-100-python",
                                "source_skipped": len(source_skipped[s])},
                         on_error=on_error, workers=workers, progress=progress, desc=f"task{t}/{s}")
        tasks.append({"name": f"task{t}", "classes": classes})
    meta_out = {"benchmark": "cifar100", "seed": seed, "class_order": order, "tasks": tasks, "class_names": names,
                "skipped_records": source_skipped}
    atomic_write_text(out / "benchmark.json", json.dumps(meta_out, indent=1))
    return meta_out


def verify_tree(out: Path) -> int:
    total = 0
    for manifest in sorted(out.glob("*/*/manifest.json")):
        total += verify(manifest.parent)
    if total == 0:
        raise DataError(f"no split directories (*/*/manifest.json) under {out}")
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--raw", type=Path, help="the cifar-100-python directory")
    ap.add_argument("--out", type=Path, default=Path("data/shards/cifar100"))
    ap.add_argument("--classes-per-task", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1993)
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--on-error", choices=["fail", "skip"], default="fail")
    ap.add_argument("--verify", type=Path, metavar="OUT", help="re-check every split under OUT and exit")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        if args.verify:
            n = verify_tree(args.verify)
            print(f"{args.verify}: every shard matches its manifest, {n} samples decode", file=sys.stderr)
            return 0
        if args.raw is None:
            ap.error("--raw is required (or use --verify)")
        meta = build(args.raw, args.out, classes_per_task=args.classes_per_task, seed=args.seed,
                     shard_size=args.shard_size, workers=args.workers, on_error=args.on_error,
                     progress=not args.no_progress)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"cifar100 at {args.out}: {len(meta['tasks'])} tasks, class order {meta['class_order'][:10]}...",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
