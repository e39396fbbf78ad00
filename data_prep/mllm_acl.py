"""MLLM-ACL (MLLM-CL's ability sequence: OCR, Math, VP, APP) -> instruction shards, for its locally scored abilities.

    python -m data_prep.mllm_acl --instructions Ability_data --out data/shards/mllm_acl \
        --annotations math=llava_v1.5_7b_MathVista_MINI.xlsx
    python -m data_prep.mllm_acl --verify data/shards/mllm_acl

Reads <instructions>/<Ability>/train.json and <instructions>/<Ability>_test/test.json, the layout MLLM-CL publishes
(bjzhb666/MLLM-CL README), each record's image relative to its own folder (or to --images when given), and writes
<out>/<task>/{train,test}. OCR is scored as eval_ocr.py (OCRBench's rule; the records' ``answer_type`` is kept for
it, a list answer kept whole), VP as eval_sat.py (mcit.core.scorers), Math as eval_math.py (mcit.core.judge:
MathVista's rules and a local judge model, eval.judge.path) against MathVista's answer table, which
``--annotations math=FILE`` joins (MLLM-CL's llava_v1.5_7b_MathVista_MINI.xlsx, or VLMEvalKit's MathVista_MINI.tsv;
question testmini_<n> is row n, and each row's question must be the record's). APP, scored by MMT-Bench's
evaluation server, is refused by name.
"""

from __future__ import annotations

from data_prep.instruction_sets import MLLM_ACL, MLLM_ACL_EXTERNAL, benchmark_main


def main(argv: list[str] | None = None) -> int:
    return benchmark_main("mllm_acl", MLLM_ACL, __doc__, argv, unsupported=MLLM_ACL_EXTERNAL)


if __name__ == "__main__":
    raise SystemExit(main())
