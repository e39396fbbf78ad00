"""LLaVA-1.5's instruction mix (``llava_v1_5_mix665k.json``) -> instruction shards, whole or as a seeded
sample (the ``data.reference`` split from which Fwd-Prompt's pre-trained subspace is estimated).

    python -m data_prep.llava_mix --json llava_v1_5_mix665k.json --images playground/data \
        --out data/shards/llava_mix665k_sample --sample 5000 --seed 0
    python -m data_prep.llava_mix --json llava_v1_5_mix665k.json --images playground/data \
        --out data/shards/llava_mix665k --sample 0        # every record
    python -m data_prep.llava_mix --verify data/shards/llava_mix665k_sample/train

Writes ``<out>/train``, the split the CoIN / UCIT configs name as ``data.reference``. Records are as
LLaVA's training reads them: ``{"id", "image"?, "conversations"}`` with image paths relative to
``--images`` (LLaVA's ``playground/data``: coco/, gqa/, ocr_vqa/, textvqa/, vg/). A multi-turn
conversation stays one sample (every answer trained with its history); a record without ``image`` (the
ShareGPT conversations) is kept as a text-only sample. ``--sample N`` draws N records without replacement
with ``numpy.random.RandomState(seed)`` and keeps them in file order; the manifest records the seed,
the size and the file's record count. Ids repeat in the mix, so samples are keyed by position + id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data_prep.common import converter_arguments, run_cli, verify
from data_prep.instruction_sets import read_items, specs_of, write_planned
from mcit.data.shards import DataError


def build(json_path: Path, images: Path | None, out: Path, *, sample: int, seed: int, on_error: str = "fail",
          **kw: Any) -> dict:
    """Convert the mix (or a seeded sample of ``sample`` records) into ``out/train``."""
    import numpy as np

    items = read_items(json_path)
    if sample < 0:
        raise DataError(f"--sample {sample}: expected 0 (every record) or a positive count")
    if sample > len(items):
        raise DataError(f"--sample {sample}: {json_path} holds only {len(items)} records")
    rows = (sorted(np.random.RandomState(seed).choice(len(items), sample, replace=False).tolist()) if sample
            else list(range(len(items))))
    picked = [items[i] for i in rows]
    specs, skipped = specs_of(json_path, images, None, on_error, unique_ids=False, items=picked, positions=rows)
    return write_planned(specs, skipped, json_path, out / "train", scorer="exact_match", on_error=on_error,
                         task="llava_mix", extra={"sample": {"size": sample, "seed": seed, "of": len(items)}}, **kw)


def main(argv: list[str] | None = None) -> int:
    ap = converter_arguments(__doc__)
    ap.add_argument("--json", type=Path, help="llava_v1_5_mix665k.json (or any LLaVA training file)")
    ap.add_argument("--images", type=Path, help="the folder the records' image paths are relative to")
    ap.add_argument("--out", type=Path, help="writes <out>/train")
    ap.add_argument("--sample", type=int, default=5000, help="records drawn without replacement (0 = every record)")
    ap.add_argument("--seed", type=int, default=0, help="the sample's numpy RandomState seed")
    return run_cli(ap, argv, lambda a: build(
        a.json, a.images, a.out, sample=a.sample, seed=a.seed, on_error=a.on_error, shard_size=a.shard_size,
        workers=a.workers, progress=not a.no_progress),
        lambda a, m: f"{a.out}/train: {m['num_samples']} samples in {len(m['shards'])} shards "
                     f"(sample {a.sample or 'all'}, seed {a.seed}, skipped {m['skipped'] + m['source_skipped']})",
        required=("json", "out"), verify_fn=verify)


if __name__ == "__main__":
    raise SystemExit(main())
