"""CUB-200-2011 (images.txt / image_class_labels.txt / train_test_split.txt / classes.txt) -> class-incremental shards.

    python -m data_prep.cub200 --raw /data/CUB_200_2011 --out data/shards/cub200 --classes-per-task 20 --seed 1993
    python -m data_prep.cub200 --verify data/shards/cub200

The official split (train_test_split.txt: ``<image id> <1 train|0 test>``) is used as it is; labels
are the 1-based ids of image_class_labels.txt minus one; class names come from classes.txt
(``001.Black_footed_Albatross`` -> ``Black footed Albatross``). Every image id must appear in all three
files exactly once; a mismatch names the id and the file.
"""

from __future__ import annotations

from pathlib import Path

from data_prep.common import RecordError, build_cil, check_unique, cil_arguments, cil_summary, run_cli
from mcit.data.shards import DataError

FILES = ("images.txt", "image_class_labels.txt", "train_test_split.txt", "classes.txt")


def read_table(path: Path, on_error: str, skipped: list[str]) -> dict[str, str]:
    """``<id> <value>`` lines as a dict; a duplicate id is an error (or skipped)."""
    if not path.is_file():
        raise DataError(f"missing file: {path} (expected the CUB_200_2011 layout: {', '.join(FILES)}, images/)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            parts = line.split(maxsplit=1)
            if len(parts) != 2:
                raise DataError(f"{path} line {n + 1}: unknown format (expected '<id> <value>')")
            rows.append((parts[0], parts[1].strip()))
    dup = check_unique([r[0] for r in rows], path, on_error)
    skipped.extend(rows[i][0] for i in sorted(dup))
    return {k: v for i, (k, v) in enumerate(rows) if i not in dup}


def build(raw: Path, out: Path, *, classes_per_task: int = 20, seed: int = 1993, shard_size: int = 1000,
          workers: int = 1, on_error: str = "fail", progress: bool = True) -> dict:
    root = raw / "CUB_200_2011" if (raw / "CUB_200_2011").is_dir() else raw
    bad: list[str] = []
    images = read_table(root / "images.txt", on_error, bad)
    labels = read_table(root / "image_class_labels.txt", on_error, bad)
    is_train = read_table(root / "train_test_split.txt", on_error, bad)
    classes = read_table(root / "classes.txt", "fail", [])
    class_ids = sorted(classes, key=int)
    if [int(c) for c in class_ids] != list(range(1, len(class_ids) + 1)):
        raise DataError(f"{root / 'classes.txt'}: class ids are not 1..{len(class_ids)}")
    names = [classes[c].split(".", 1)[-1].replace("_", " ") for c in class_ids]
    splits: dict[str, list] = {"train": [], "test": []}
    skipped: dict[str, list[str]] = {"train": [], "test": []}
    for img_id, rel in images.items():
        try:
            if img_id not in labels:
                raise RecordError(img_id, root / "image_class_labels.txt", "image id has no class label")
            if img_id not in is_train or is_train[img_id] not in ("0", "1"):
                raise RecordError(img_id, root / "train_test_split.txt", "image id has no 0/1 split entry")
            label = int(labels[img_id]) - 1
            if not 0 <= label < len(names):
                raise RecordError(img_id, root / "image_class_labels.txt", f"label {label + 1} outside 1..{len(names)}")
        except RecordError:
            if on_error == "fail":
                raise
            skipped["train"].append(img_id)
            continue
        s = "train" if is_train[img_id] == "1" else "test"
        splits[s].append((f"cub_{int(img_id):06d}" if img_id.isdigit() else img_id, str(root / "images" / rel), label,
                          img_id))
    skipped["train"].extend(bad)
    return build_cil(out, splits, names, benchmark="cub200", classes_per_task=classes_per_task, seed=seed,
                     source_skipped=skipped, shard_size=shard_size, workers=workers, on_error=on_error,
                     progress=progress, extra={"raw_format": "CUB_200_2011", "split": "train_test_split.txt"})


def main(argv: list[str] | None = None) -> int:
    ap = cil_arguments(__doc__, raw_help="the CUB_200_2011 directory (or its parent)", classes_per_task=20, seed=1993,
                       out="data/shards/cub200")
    return run_cli(ap, argv, lambda a: build(a.raw, a.out, classes_per_task=a.classes_per_task, seed=a.seed,
                                             shard_size=a.shard_size, workers=a.workers, on_error=a.on_error,
                                             progress=not a.no_progress), cil_summary("cub200"))


if __name__ == "__main__":
    raise SystemExit(main())
