"""LLaVA-format instruction data (the CoIN / UCIT JSON + an image folder) -> one shard split.

    python -m data_prep.llava_json --json coin/ScienceQA/train.json --images coin/images \
        --out data/shards/coin/scienceqa/train --scorer multiple_choice

Each JSON item is ``{"id", "image" (path under --images), "conversations": [{"from": "human",
"value": "<image>\\n..."}, {"from": "gpt", "value": ...}, ...]}`` plus optional ``answers`` (VQA
annotators) and ``box`` (grounding). Multi-turn items become one sample per turn. A bad item stops the
conversion with one line naming the JSON file, the item and the problem; nothing is written until
every item has been read (the split's shards are then written, the manifest last).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mcit import scorers as S
from mcit.data.instructions import records_from_llava_json, write_instruction_split
from mcit.data.shards import DataError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--images", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scorer", default="exact_match", choices=sorted(S.SCORERS))
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--limit", type=int, default=0, help="convert only the first N samples (0 = all)")
    args = ap.parse_args(argv)
    if (args.out / "manifest.json").exists():
        print(f"error: {args.out} already holds a split (manifest.json); remove it or choose another --out",
              file=sys.stderr)
        return 2
    try:
        samples = []
        for rec in records_from_llava_json(args.json, args.images):
            samples.append(rec)
            if args.limit and len(samples) >= args.limit:
                break
        manifest = write_instruction_split(args.out, samples, shard_size=args.shard_size, scorer=args.scorer,
                                           extra={"source": str(args.json)})
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {manifest['num_samples']} samples in {len(manifest['shards'])} shards (scorer {args.scorer})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
