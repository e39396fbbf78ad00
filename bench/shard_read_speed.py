"""Reading instruction samples from the shards data_prep writes vs from the raw JSON + image folder.

One run builds a CoIN-style task (a LLaVA JSON list + a folder of JPEGs, sizes like real VQA photos),
converts it with data_prep (the same code as ``python -m data_prep.llava_json``), and times reading
every sample both ways, interleaved, best of ``--repeats``:

* raw:    json.load of the annotation file, then per record open + read the image file (what the
          LLaVA / CoIN data loaders do per sample);
* shards: the pipeline's reader (mcit.data.shards.iter_samples) over the tar shards.

Each is measured "cold" (every file's pages dropped from the page cache with posix_fadvise
DONTNEED before the pass, as on a dataset larger than RAM or a fresh node), "warm" (all in the page
cache) and "warm + decode" (the JPEG decoded to RGB and the record parsed, the full sample cost).
It prints samples/s and the shards/raw ratio for each; the target is shards >= 2x on the cold read.

    python bench/shard_read_speed.py [--samples 4000] [--size 480 360] [--repeats 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make_raw(root: Path, n: int, size: tuple[int, int]) -> Path:
    """n JPEG photos (smooth noise, ~real VQA file sizes) in 100 sub-folders + one LLaVA JSON list."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(0)
    items = []
    w, h = size
    for i in range(n):
        small = rng.randint(0, 255, (h // 8, w // 8, 3)).astype(np.uint8)
        im = Image.fromarray(small).resize((w, h), Image.BILINEAR)
        arr = np.asarray(im).astype(np.int16) + rng.randint(-12, 12, (h, w, 3))
        rel = f"images/{i % 100:03d}/{i:07d}.jpg"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(root / rel, quality=90)
        items.append({"id": f"q{i}", "image": rel, "conversations": [
            {"from": "human",
             "value": f"<image>\nWhat is shown in picture {i}? Answer the question using a single word."},
            {"from": "gpt", "value": f"answer{i % 37}"}]})
    (root / "train.json").write_text(json.dumps(items))
    return root / "train.json"


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd) if os.access(p, os.W_OK) else None
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_raw(json_path: Path, root: Path, decode: bool) -> int:
    from PIL import Image

    n = 0
    for item in json.loads(json_path.read_text()):
        with open(root / item["image"], "rb") as f:
            data = f.read()
        if decode:
            Image.open(io.BytesIO(data)).convert("RGB")
            _ = (item["conversations"][0]["value"], item["conversations"][1]["value"])
        n += 1
    return n


def read_shards(split_dir: Path, decode: bool) -> int:
    from mcit.data.instructions import decode_instruction
    from mcit.data.shards import iter_samples, open_split

    split = open_split(split_dir)
    n = 0
    for s in iter_samples(split, 0, 1, policy="shard"):
        if decode:
            decode_instruction(s)
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--size", type=int, nargs=2, default=[480, 360], metavar=("W", "H"))
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="build the data here and keep it (default: a temporary folder)")
    args = ap.parse_args()
    from data_prep.instruction_sets import convert_split

    root = args.keep or Path(tempfile.mkdtemp(prefix="mcit-bench-read-"))
    try:
        t0 = time.perf_counter()
        json_path = make_raw(root / "raw", args.samples, tuple(args.size))
        t1 = time.perf_counter()
        convert_split(json_path, root / "shards", images=root / "raw", scorer="exact_match",
                      shard_size=args.shard_size, progress=False)
        t2 = time.perf_counter()
        raw_files = [json_path, *sorted((root / "raw" / "images").rglob("*.jpg"))]
        shard_files = sorted((root / "shards").glob("*.tar")) + [root / "shards" / "manifest.json"]
        raw_bytes = sum(p.stat().st_size for p in raw_files)
        shard_bytes = sum(p.stat().st_size for p in shard_files)
        print(f"{args.samples} samples, {args.size[0]}x{args.size[1]} JPEG: raw {raw_bytes / 2**20:.1f} MiB in "
              f"{len(raw_files)} files (made in {t1 - t0:.1f} s); shards {shard_bytes / 2**20:.1f} MiB in "
              f"{len(shard_files)} files (converted in {t2 - t1:.1f} s)")
        results: dict[str, dict[str, float]] = {}
        for mode in ("cold", "warm", "warm + decode"):
            best = {"raw": 0.0, "shards": 0.0}
            for _ in range(args.repeats):
                for name in ("raw", "shards"):  # interleaved, so drift on a noisy machine hits both
                    files = raw_files if name == "raw" else shard_files
                    if mode == "cold":
                        drop_cache(files)
                    else:
                        for p in files:  # make sure every page is cached
                            p.read_bytes()
                    decode = mode.endswith("decode")
                    t = time.perf_counter()
                    n = read_raw(json_path, root / "raw", decode) if name == "raw" else \
                        read_shards(root / "shards", decode)
                    dt = time.perf_counter() - t
                    assert n == args.samples, (name, n)
                    best[name] = max(best[name], n / dt)
            results[mode] = best
            print(f"{mode:>14}: raw JSON + images {best['raw']:9.0f} samples/s | shards {best['shards']:9.0f} "
                  f"samples/s | shards/raw {best['shards'] / best['raw']:.2f}x")
        ratio = results["cold"]["shards"] / results["cold"]["raw"]
        print(f"cold read ratio {ratio:.2f}x (target >= 2x): {'met' if ratio >= 2 else 'NOT met'}")
        print(json.dumps({m: {k: round(v, 1) for k, v in r.items()} for m, r in results.items()}))
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
