"""CoIN (ScienceQA, TextVQA, ImageNet, GQA, VizWiz, Grounding, VQAv2, OCR-VQA) -> instruction shards.

    python -m data_prep.coin --instructions playground/Instructions_Original --images cl_dataset \
        --out data/shards/coin [--task scienceqa textvqa ...] [--annotations textvqa=TextVQA_0.5.1_val.json]
    python -m data_prep.coin --verify data/shards/coin

Reads <instructions>/<Task>/{train,test}.json (or .jsonl / .parquet / .arrow / a saved dataset folder)
and writes <out>/<task>/{train,test}, the layout configs/coin_llava7b_fwd_prompt.yaml reads. See
data_prep.instruction_sets for the record forms and the checks.
"""

from __future__ import annotations

from data_prep.instruction_sets import COIN, benchmark_main


def main(argv: list[str] | None = None) -> int:
    return benchmark_main("coin", COIN, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
