"""MLLM-DCL (MLLM-CL's domain sequence: RS, Med, AD, Sci, Fin) -> instruction shards.

    python -m data_prep.mllm_dcl --instructions Domain_data --out data/shards/mllm_dcl
    python -m data_prep.mllm_dcl --verify data/shards/mllm_dcl

Reads <instructions>/<Domain>/{train,test}.json, the layout MLLM-CL publishes (bjzhb666/MLLM-CL README; MCITlib's
Domain_data, configs/data_configs/MLLM-DCL/*.json), each record's image relative to its domain folder (or to
--images when given), and writes <out>/<task>/{train,test}, the layout configs/dcl_llava7b_*.yaml read. Each test
split is scored by MLLM-CL's own script for its domain (mcit.core.scorers: RS and AD eval_ai2d, Med eval_pvqa,
Sci eval_sci, Fin eval_finvis). See data_prep.instruction_sets for the record forms and the checks.
"""

from __future__ import annotations

from data_prep.instruction_sets import MLLM_DCL, benchmark_main


def main(argv: list[str] | None = None) -> int:
    return benchmark_main("mllm_dcl", MLLM_DCL, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
