"""MLLM-ACL (MLLM-CL's ability sequence: OCR, Math, VP, APP) -> instruction shards, for its locally scored abilities.

    python -m data_prep.mllm_acl --instructions Ability_data --out data/shards/mllm_acl --task ocr vp
    python -m data_prep.mllm_acl --verify data/shards/mllm_acl

Reads <instructions>/<Ability>/train.json and <instructions>/<Ability>_test/test.json, the layout MLLM-CL publishes
(bjzhb666/MLLM-CL README), each record's image relative to its own folder (or to --images when given), and writes
<out>/<task>/{train,test}. OCR is scored as eval_ocr.py (OCRBench's rule; the records' ``answer_type`` is kept for
it, a list answer kept whole), VP as eval_sat.py (mcit.core.scorers). Math (a GPT judge against MathVista's answer
table) and APP (MMT-Bench's evaluation server) are refused by name: neither has a local rule to score it.
"""

from __future__ import annotations

from data_prep.instruction_sets import MLLM_ACL, MLLM_ACL_EXTERNAL, benchmark_main


def main(argv: list[str] | None = None) -> int:
    return benchmark_main("mllm_acl", MLLM_ACL, __doc__, argv, unsupported=MLLM_ACL_EXTERNAL)


if __name__ == "__main__":
    raise SystemExit(main())
