"""Tables and figures of a study made of sweeps (the selection rule, the seeds table, the plots under docs/).

    mcit-study --selection runs/sweeps/tiny_mcit_tuning_prompts runs/sweeps/tiny_mcit_tuning_lora \\
        runs/sweeps/tiny_mcit_fwd_prompt_ablation --final runs/sweeps/tiny_mcit_seeds --out docs/mcit_study

(or ``python -m mcit.cli.study``); the rule and the columns: ``mcit/studies/study.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mcit.cli import common


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--selection", nargs="+", type=Path, default=[], help="sweeps on the validation carve")
    ap.add_argument("--final", type=Path, default=None, help="the sweep of the chosen defaults on the test split")
    ap.add_argument("--out", type=Path, default=None, help="write <out>.md and the figures beside it")
    ap.add_argument("--published", action="append", type=Path, default=[], metavar="FILE",
                    help="a published file (published/*.yaml): its numbers beside the final sweep's, with delta")
    args = ap.parse_args(argv)
    if not args.selection and args.final is None:
        ap.error("nothing to tabulate: give --selection SWEEP ... and/or --final SWEEP")
    from mcit.studies.published import PublishedError
    from mcit.studies.study import write_study

    try:
        text, made = write_study(args.selection, args.final, args.out, args.published)
    except PublishedError as e:  # a bad published file, or a method the study lacks: one line, exit 2
        return common.fail(str(e))
    except Exception as e:  # noqa: BLE001 - a missing sweep or config: one line, exit 2
        return common.before_launch(e)
    print(text, end="")
    for p in made:
        print(f"wrote {p}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
