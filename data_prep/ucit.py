"""UCIT (ImageNet-R, ArxivQA, VizWiz (captions), IconQA, CLEVR-Math, Flickr30k) -> instruction shards.

    python -m data_prep.ucit --instructions UCIT --images UCIT/datasets --out data/shards/ucit
    python -m data_prep.ucit --verify data/shards/ucit

Reads <instructions>/<Task>/{train,test}.json, MCITlib's UCIT layout (Ghy0501/MCITlib: ArxivQA, CLEVR-Math, Flickr30k,
IconQA, ImageNet-R, VizWiz; or .jsonl / .parquet / .arrow / a saved dataset folder)
and writes <out>/<task>/{train,test}, the layout configs/ucit_llava7b_fwd_prompt.yaml reads. See
data_prep.instruction_sets for the record forms and the checks.
"""

from __future__ import annotations

from data_prep.instruction_sets import UCIT, benchmark_main


def main(argv: list[str] | None = None) -> int:
    return benchmark_main("ucit", UCIT, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
