"""ImageNet-R (class folders imagenet-r/<wnid>/*.jpg) -> class-incremental shards with an 80/20 split.

    python -m data_prep.imagenet_r --raw /data/imagenet-r --out data/shards/imagenet_r \
        --classes-per-task 20 --seed 1993 --split-seed 42 [--class-names imagenet_r_classnames.txt]
    python -m data_prep.imagenet_r --raw /data --train-list imagenet_r_train.txt --test-list imagenet_r_val.txt ...
    python -m data_prep.imagenet_r --verify data/shards/imagenet_r

Classes are the sorted folder names (torchvision ImageFolder's order, so class c is the c-th wnid);
the files of a class are sorted. ImageNet-R has no official split: the prompt-based CIL code bases
(l2p-pytorch / dualprompt-pytorch) take ``torch.utils.data.random_split`` of that ImageFolder list
into 80% train / 20% test. We do the same permutation with an explicit generator,
``torch.randperm(n, generator=torch.Generator().manual_seed(split_seed))``, first int(0.8 n) to train,
so the split depends on ``--split-seed`` alone (theirs depends on whatever consumed the global RNG
before). Given ``--train-list/--test-list`` (lines of paths relative to --raw, as VPT-NSP²'s tools
ship them), those lists are used instead. The split and the class order are recorded in every manifest.
"""

from __future__ import annotations

from pathlib import Path

from data_prep.common import build_cil, check_unique, cil_arguments, cil_summary, run_cli
from mcit.data.instructions import IMAGE_EXTS
from mcit.data.shards import DataError

SUFFIXES = tuple(f".{e}" for e in IMAGE_EXTS)


def class_folders(root: Path) -> list[str]:
    if not root.is_dir():
        raise DataError(f"missing directory: {root} (expected imagenet-r/<wnid>/<image>.jpg)")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"{root}: unknown format (no class folders)")
    return classes


def read_class_names(path: Path | None, classes: list[str]) -> list[str]:
    """Readable names from ``<wnid> <name>`` lines; the wnid where no file is given."""
    if path is None:
        return list(classes)
    names: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            parts = line.split(maxsplit=1)
            if len(parts) != 2:
                raise DataError(f"{path} line {n + 1}: expected '<wnid> <name>'")
            names[parts[0]] = parts[1].replace("_", " ")
    missing = [c for c in classes if c not in names]
    if missing:
        raise DataError(f"{path}: no name for {missing[:5]}")
    return [names[c] for c in classes]


def _spec(path: Path, root: Path, label: int) -> tuple[str, str, int, str]:
    rid = path.relative_to(root).as_posix()
    return rid.replace("/", "__").rsplit(".", 1)[0], str(path), label, rid


def seeded_split(root: Path, classes: list[str], split_seed: int, train_fraction: float = 0.8
                 ) -> dict[str, list[tuple[str, str, int, str]]]:
    import torch

    files = [(p, c) for c, wnid in enumerate(classes) for p in sorted((root / wnid).iterdir())
             if p.is_file() and p.suffix.lower() in SUFFIXES + (".webp", ".bmp", ".gif")]
    perm = torch.randperm(len(files), generator=torch.Generator().manual_seed(split_seed)).tolist()
    n_train = int(train_fraction * len(files))
    pick = {"train": perm[:n_train], "test": perm[n_train:]}
    return {s: [_spec(files[i][0], root, files[i][1]) for i in sorted(idx)] for s, idx in pick.items()}


def listed_split(raw: Path, classes: list[str], lists: dict[str, Path]) -> dict[str, list[tuple[str, str, int, str]]]:
    """Splits from list files of paths relative to ``raw`` (``<...>/<wnid>/<file>``); the class is the
    parent folder."""
    index = {w: c for c, w in enumerate(classes)}
    out: dict[str, list] = {}
    for s, lst in lists.items():
        if not lst.is_file():
            raise DataError(f"missing file: {lst}")
        specs = []
        for n, line in enumerate(lst.read_text().splitlines()):
            rel = line.strip().split()[0] if line.strip() else ""
            if not rel:
                continue
            wnid = Path(rel).parent.name
            if wnid not in index:
                raise DataError(f"{lst} line {n + 1}: class folder {wnid!r} of {rel!r} is not a class of {raw}")
            specs.append((rel.replace("/", "__").rsplit(".", 1)[0], str(raw / rel), index[wnid], rel))
        out[s] = specs
    return out


def build(raw: Path, out: Path, *, classes_per_task: int = 20, seed: int = 1993, split_seed: int = 42,
          train_list: Path | None = None, test_list: Path | None = None, class_names: Path | None = None,
          shard_size: int = 1000, workers: int = 1, on_error: str = "fail", progress: bool = True) -> dict:
    root = raw / "imagenet-r" if (raw / "imagenet-r").is_dir() else raw
    classes = class_folders(root)
    if (train_list is None) != (test_list is None):
        raise DataError("give both --train-list and --test-list, or neither (seeded 80/20 split)")
    if train_list is not None:
        splits = listed_split(raw, classes, {"train": train_list, "test": test_list})
        how = {"split": "lists", "train_list": str(train_list), "test_list": str(test_list)}
    else:
        splits = seeded_split(root, classes, split_seed)
        how = {"split": "random_split 0.8/0.2", "split_seed": split_seed}
    skipped: dict[str, list[str]] = {}
    for s, specs in splits.items():
        dup = check_unique([r[3] for r in specs], train_list or test_list or root, on_error)
        skipped[s] = [specs[i][3] for i in sorted(dup)]
        splits[s] = [r for i, r in enumerate(specs) if i not in dup]
    both = {r[3] for r in splits["train"]} & {r[3] for r in splits["test"]}
    if both:
        raise DataError(f"{sorted(both)[0]!r} is in both the train and the test split")
    return build_cil(out, splits, read_class_names(class_names, classes), benchmark="imagenet_r",
                     classes_per_task=classes_per_task, seed=seed, source_skipped=skipped, shard_size=shard_size,
                     workers=workers, on_error=on_error, progress=progress,
                     extra={"raw_format": "class folders", "wnids": classes, **how})


def main(argv: list[str] | None = None) -> int:
    ap = cil_arguments(__doc__, raw_help="the imagenet-r directory (or its parent)", classes_per_task=20, seed=1993,
                       out="data/shards/imagenet_r")
    ap.add_argument("--split-seed", type=int, default=42, help="seed of the 80/20 train/test split")
    ap.add_argument("--train-list", type=Path, help="fixed split: relative image paths, one per line")
    ap.add_argument("--test-list", type=Path)
    ap.add_argument("--class-names", type=Path, help="'<wnid> <name>' lines")
    return run_cli(ap, argv, lambda a: build(
        a.raw, a.out, classes_per_task=a.classes_per_task, seed=a.seed, split_seed=a.split_seed,
        train_list=a.train_list, test_list=a.test_list, class_names=a.class_names, shard_size=a.shard_size,
        workers=a.workers, on_error=a.on_error, progress=not a.no_progress), cil_summary("imagenet_r"))


if __name__ == "__main__":
    raise SystemExit(main())
