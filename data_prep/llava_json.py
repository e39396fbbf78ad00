"""One instruction file (LLaVA JSON, CoIN question file, JSON lines, parquet / arrow / a saved dataset)
+ an image folder -> one shard split.

    python -m data_prep.llava_json --json coin/ScienceQA/train.json --images coin/images \
        --out data/shards/coin/scienceqa/train --scorer multiple_choice
    python -m data_prep.llava_json --json TextVQA/test.json --annotations TextVQA_0.5.1_val.json ...

For whole benchmarks use ``python -m data_prep.coin`` / ``python -m data_prep.ucit``; the record forms
and checks are those of data_prep.instruction_sets. Resumable like every converter (data_prep.common).
"""

from __future__ import annotations

from pathlib import Path

from data_prep.common import converter_arguments, run_cli, verify
from data_prep.instruction_sets import convert_split
from mcit.core import caption_metrics as C
from mcit.core import scorers as S


def main(argv: list[str] | None = None) -> int:
    ap = converter_arguments(__doc__)
    ap.add_argument("--json", type=Path, help="the instruction file")
    ap.add_argument("--images", type=Path, help="the folder the records' image paths are relative to")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--annotations", type=Path, help="original annotation file joined on question_id")
    ap.add_argument("--scorer", default="exact_match", choices=sorted([*S.SCORERS, *C.CORPUS]))
    ap.add_argument("--limit", type=int, default=0, help="convert only the first N samples (0 = all)")
    return run_cli(ap, argv, lambda a: convert_split(
        a.json, a.out, images=a.images, scorer=a.scorer, annotations=a.annotations, shard_size=a.shard_size,
        workers=a.workers, on_error=a.on_error, progress=not a.no_progress, limit=a.limit),
        lambda a, m: f"{a.out}: {m['num_samples']} samples in {len(m['shards'])} shards (scorer {a.scorer}, "
                     f"skipped {m['skipped'] + m['source_skipped']})",
        required=("json", "out"), verify_fn=verify)


if __name__ == "__main__":
    raise SystemExit(main())
