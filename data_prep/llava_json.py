"""One instruction file (LLaVA JSON, CoIN question file, JSON lines, parquet / arrow / a saved dataset)
+ an image folder -> one shard split.

    python -m data_prep.llava_json --json coin/ScienceQA/train.json --images coin/images \
        --out data/shards/coin/scienceqa/train --scorer multiple_choice
    python -m data_prep.llava_json --json TextVQA/test.json --annotations TextVQA_0.5.1_val.json ...

For whole benchmarks use ``python -m data_prep.coin`` / ``python -m data_prep.ucit``; the record forms
and checks are those of data_prep.instruction_sets. Resumable like every converter (data_prep.common).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_prep.common import verify
from data_prep.instruction_sets import convert_split
from mcit import scorers as S
from mcit.data.shards import DataError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="the instruction file")
    ap.add_argument("--images", type=Path, help="the folder the records' image paths are relative to")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--annotations", type=Path, help="original annotation file joined on question_id")
    ap.add_argument("--scorer", default="exact_match", choices=sorted(S.SCORERS))
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--on-error", choices=["fail", "skip"], default="fail")
    ap.add_argument("--limit", type=int, default=0, help="convert only the first N samples (0 = all)")
    ap.add_argument("--verify", type=Path, metavar="SPLIT", help="re-check a split directory and exit")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        if args.verify:
            n = verify(args.verify)
            print(f"{args.verify}: every shard matches its manifest, {n} samples decode", file=sys.stderr)
            return 0
        if args.json is None or args.out is None:
            ap.error("--json and --out are required (or use --verify)")
        m = convert_split(args.json, args.out, images=args.images, scorer=args.scorer, annotations=args.annotations,
                          shard_size=args.shard_size, workers=args.workers, on_error=args.on_error,
                          progress=not args.no_progress, limit=args.limit)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {m['num_samples']} samples in {len(m['shards'])} shards (scorer {args.scorer}, "
          f"skipped {m['skipped'] + m['source_skipped']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
