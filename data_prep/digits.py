"""The embedded class-incremental benchmark: scikit-learn's handwritten digits as shards.

1,797 real 8x8 grey-level digits (they ship inside scikit-learn, no download), split 80/20 per class
with a seed, classes put in a seeded order and cut into tasks of ``classes_per_task`` classes. Each
task gets ``<out>/<task>/{train,test}/`` with a manifest; ``<out>/benchmark.json`` records the order.

    python -m data_prep.digits --out data/shards/digits
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from data_prep.common import builder_main
from mcit.core.checkpoint import publish_dir, staging_dir
from mcit.data.shards import open_split, write_split

CLASS_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _png(image_0_16: np.ndarray) -> bytes:
    from PIL import Image

    arr = np.clip(np.rint(image_0_16 * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, mode="L").save(buf, format="PNG")
    return buf.getvalue()


def build(out: Path, *, seed: int = 0, classes_per_task: int = 2, test_fraction: float = 0.2,
          shard_size: int = 64, force: bool = False) -> dict:
    """Write the benchmark under ``out``; a complete existing build with the same settings is kept."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    settings = {"seed": seed, "classes_per_task": classes_per_task, "test_fraction": test_fraction,
                "shard_size": shard_size}
    meta_path = out / "benchmark.json"
    if meta_path.is_file() and not force:
        meta = json.loads(meta_path.read_text())
        if meta.get("settings") == settings:
            try:
                for t in meta["tasks"]:
                    open_split(out / t["name"] / "train")
                    open_split(out / t["name"] / "test")
                return meta
            except ValueError:
                pass  # incomplete or damaged: rebuild below
    if 10 % classes_per_task:
        raise SystemExit(f"--classes-per-task {classes_per_task} does not divide 10 classes")

    digits = load_digits()
    images, labels = digits.images, digits.target.astype(int)
    idx = np.arange(len(labels))
    train_idx, test_idx = train_test_split(idx, test_size=test_fraction, random_state=seed, stratify=labels)
    order = [int(c) for c in np.random.RandomState(seed).permutation(10)]

    tasks = []
    tmp_root = staging_dir(out)
    for t in range(10 // classes_per_task):
        classes = order[t * classes_per_task:(t + 1) * classes_per_task]
        name = f"task{t}"
        for split_name, split_idx in (("train", train_idx), ("test", test_idx)):
            chosen = [int(i) for i in sorted(split_idx) if labels[i] in classes]
            samples = [{"__key__": f"digit{i:05d}", "png": _png(images[i]), "cls": int(labels[i]),
                        "json": {"id": int(i), "label": int(labels[i])}} for i in chosen]
            write_split(tmp_root / name / split_name, samples, shard_size=shard_size, label_space=classes,
                        class_names={c: CLASS_NAMES[c] for c in classes},
                        extra={"task": name, "source": "sklearn.datasets.load_digits"})
        tasks.append({"name": name, "classes": classes})
    meta = {"benchmark": "digits", "settings": settings, "class_order": order, "tasks": tasks,
            "class_names": CLASS_NAMES}
    publish_dir(tmp_root, out, files={"benchmark.json": json.dumps(meta, indent=1)})
    return meta


def main(argv: list[str] | None = None) -> int:
    return builder_main(__doc__, build,
                        lambda a, meta: f"digits benchmark at {a.out}: class order {meta['class_order']}, "
                                        f"{len(meta['tasks'])} tasks",
                        argv, out="data/shards/digits", options=("seed", "classes_per_task", "shard_size"))


if __name__ == "__main__":
    raise SystemExit(main())
