"""CoIN (ScienceQA, TextVQA, ImageNet, GQA, VizWiz, Grounding, VQAv2, OCR-VQA) -> instruction shards.

    python -m data_prep.coin --instructions playground/Instructions_Original --images cl_dataset \
        --out data/shards/coin [--task scienceqa textvqa ...] [--annotations textvqa=TextVQA_0.5.1_val.json]
    python -m data_prep.coin --verify data/shards/coin

Reads <instructions>/<Task>/train.json and the file CoIN's evaluation scripts read as the test split
(val.json for TextVQA, VizWiz and VQAv2, test.json for the others; .jsonl / .parquet / .arrow / a saved
dataset folder as well) and writes <out>/<task>/{train,test}, the layout configs/coin_llava7b_fwd_prompt.yaml
reads, each split scored by CoIN's own script for that task (mcit.core.scorers, coin_*). See
data_prep.instruction_sets for the record forms and the checks.
"""

from __future__ import annotations

from data_prep.instruction_sets import COIN, benchmark_main


def main(argv: list[str] | None = None) -> int:
    return benchmark_main("coin", COIN, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
