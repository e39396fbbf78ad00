"""Print the summary of one or more finished runs, and a side-by-side table of their final metrics.

    mcit-report runs/digits_seq runs/digits_l2p          (or python -m mcit.cli.report ...)
    mcit-report --zero-shot-of runs/tiny_mcit_lora runs/tiny_mcit_lora runs/tiny_mcit_multitask

``--zero-shot-of RUN`` adds a first column for the pre-trained backbone itself: the averages of that run's
zero-shot row (the same test samples, nothing trained). A run with ``data.schedule: joint`` (the multi-task
bound) is labelled ``multitask``. Runs that have not finished are left out, each named on stderr; exit 2 where
none has.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mcit.cli import common


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--zero-shot-of", type=Path, metavar="RUN",
                    help="add a zero-shot column: the averages of this run's zero-shot row")
    args = ap.parse_args(argv)
    from mcit.studies.report import comparison

    try:
        text, skipped = comparison(args.run_dirs, args.zero_shot_of)
    except Exception as e:  # noqa: BLE001 - no finished run, or an unreadable one: one line, exit 2
        return common.before_launch(e)
    print(text)
    sys.stdout.flush()
    for line in skipped:  # a glob over runs/ catches runs still going: named, not fatal
        print(f"skipped {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
