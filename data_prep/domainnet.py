"""DomainNet from its txt file lists (``<domain>/<class>/<file>.jpg <label>`` per line) -> class-incremental shards.

    python -m data_prep.domainnet --raw /data/domainnet --train-list sdomain_train.txt \
        --test-list sdomain_val.txt --out data/shards/domainnet --classes-per-task 20 --seed 1993
    python -m data_prep.domainnet --verify data/shards/domainnet

The lists decide the subset: VPT-NSP²'s ``sdomain_{train,val}.txt`` give the standard 200-class
subset (labels 0..199 over all six domains); the official per-domain lists (``clipart_train.txt``, ...)
give all 345 classes, and several lists may be passed at once. Paths are relative to --raw. The
class name of a label is its folder name, and every line of a label must agree on it. The domain of
each image is kept in its json (``domain``) so per-domain accuracy can be computed later.
"""

from __future__ import annotations

from pathlib import Path

from data_prep.common import (
    RecordError,
    build_cil,
    check_unique,
    cil_arguments,
    cil_summary,
    encode_image_file,
    run_cli,
)
from mcit.data.shards import DataError


def read_list(path: Path, raw: Path) -> list[tuple[str, str, int, str]]:
    if not path.is_file():
        raise DataError(f"missing file: {path}")
    specs = []
    for n, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit() or len(Path(parts[0]).parts) < 3:
            raise DataError(f"{path} line {n + 1}: unknown format (expected '<domain>/<class>/<file> <label>')")
        rel, label = parts[0], int(parts[1])
        specs.append((rel.replace("/", "__").rsplit(".", 1)[0], str(raw / rel), label, rel))
    return specs


def encode(spec: tuple[str, str, int, str]) -> dict:
    sample = encode_image_file(spec)
    sample["json"]["domain"] = Path(spec[3]).parts[0]
    return sample


def build(raw: Path, out: Path, *, train_lists: list[Path], test_lists: list[Path], classes_per_task: int = 20,
          seed: int = 1993, shard_size: int = 1000, workers: int = 1, on_error: str = "fail",
          progress: bool = True) -> dict:
    splits, skipped = {}, {}
    names: dict[int, str] = {}
    for s, lists in (("train", train_lists), ("test", test_lists)):
        specs = []
        for lst in lists:
            for spec in read_list(lst, raw):
                cls_name = Path(spec[3]).parts[1]
                if names.setdefault(spec[2], cls_name) != cls_name:
                    raise RecordError(spec[3], lst,
                                      f"label {spec[2]} is {names[spec[2]]!r} elsewhere, {cls_name!r} here")
                specs.append(spec)
        dup = check_unique([r[3] for r in specs], ", ".join(map(str, lists)), on_error)
        skipped[s] = [specs[i][3] for i in sorted(dup)]
        splits[s] = [r for i, r in enumerate(specs) if i not in dup]
    labels = sorted(names)
    if labels != list(range(len(labels))):
        raise DataError(f"labels of {train_lists[0]} are not 0..{len(labels) - 1} "
                        f"(missing {sorted(set(range(max(labels) + 1)) - set(labels))[:5]})")
    return build_cil(out, splits, [names[c] for c in labels], benchmark="domainnet", classes_per_task=classes_per_task,
                     seed=seed, encode=encode, source_skipped=skipped, shard_size=shard_size, workers=workers,
                     on_error=on_error, progress=progress,
                     extra={"raw_format": "txt lists", "lists": {"train": [str(p) for p in train_lists],
                                                                 "test": [str(p) for p in test_lists]}})


def main(argv: list[str] | None = None) -> int:
    ap = cil_arguments(__doc__, raw_help="the DomainNet root (holding clipart/, real/, ...)", classes_per_task=20,
                       seed=1993, out="data/shards/domainnet")
    ap.add_argument("--train-list", type=Path, nargs="+", help="txt lists of training images")
    ap.add_argument("--test-list", type=Path, nargs="+", help="txt lists of test images")

    def _build(a):
        if not a.train_list or not a.test_list:
            raise DataError("--train-list and --test-list are required")
        return build(a.raw, a.out, train_lists=a.train_list, test_lists=a.test_list,
                     classes_per_task=a.classes_per_task, seed=a.seed, shard_size=a.shard_size, workers=a.workers,
                     on_error=a.on_error, progress=not a.no_progress)

    return run_cli(ap, argv, _build, cil_summary("domainnet"))


if __name__ == "__main__":
    raise SystemExit(main())
