"""Print the summary of one or more finished runs, and a side-by-side table of their final metrics.

    mcit-report runs/digits_seq runs/digits_l2p          (or python -m mcit.cli.report ...)
    mcit-report --zero-shot-of runs/tiny_mcit_lora runs/tiny_mcit_lora runs/tiny_mcit_multitask

``--zero-shot-of RUN`` adds a first column for the pre-trained backbone itself: the averages of that run's
zero-shot row (the same test samples, nothing trained). A run with ``data.schedule: joint`` (the multi-task
bound) is labelled ``multitask``. Runs that have not finished are left out, each named on stderr; exit 2 where
none has.

Where a run has its report.html (``mcit.run.html_report``: one self-contained page, opens offline), the last
lines say where. ``--html`` (re)writes it for each run directory and each sweep directory given (those written
before the page existed):

    mcit-report --html runs/tiny_mcit_lora runs/sweeps/digits_l2p

``--published FILE`` (``published/*.yaml``; format: ``mcit/studies/published.py``) adds the numbers a paper prints
beside ours (a run's value, a sweep's mean ± std) and Δ, to the printed tables and, with ``--html``, to the pages.
A wrong metric name, or a method the runs lack for a benchmark they cover, is a one-line error:

    mcit-report --published published/norga.yaml runs/sweeps/cifar100_10
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
    ap.add_argument("--html", action="store_true",
                    help="write report.html for each run or sweep directory given, and print where each is")
    ap.add_argument("--published", action="append", type=Path, default=[], metavar="FILE",
                    help="a published file (published/*.yaml): add the published / ours / delta table (repeatable)")
    args = ap.parse_args(argv)
    from mcit.studies.report import comparison, published_table, unfinished, write_html

    made: list[Path] = []
    table, pairs = "", []
    if args.published:
        from mcit.studies.published import PublishedError

        try:
            table, pairs = published_table(args.published, args.run_dirs)
        except PublishedError as e:  # a bad file, a metric or a method the runs lack: one line, exit 2
            return common.fail(str(e))
        except Exception as e:  # noqa: BLE001 - an unreadable run: one line, exit 2
            return common.before_launch(e)
    if args.html:
        try:
            made, skipped = write_html(args.run_dirs, pairs)
        except Exception as e:  # noqa: BLE001 - an unreadable run or sweep: one line, exit 2
            return common.before_launch(e)
        if not made:
            return common.fail("no finished run or sweep to write a report for: " + "; ".join(skipped))
    runs = [d for d in args.run_dirs if not (d / "aggregate.json").is_file()]
    skipped = []
    if runs:
        try:
            text, skipped = comparison(runs, args.zero_shot_of)
        except Exception as e:  # noqa: BLE001 - no finished run, or an unreadable one: one line, exit 2
            if not made:
                return common.before_launch(e)
            text, skipped = "", [str(e)]
        print(text)
    if table:
        print(table)
    pages = made or [d / "report.html" for d in runs if (d / "report.html").is_file() and unfinished(d) is None]
    for path in pages:
        print(f"HTML report: {path}")
    sys.stdout.flush()
    for line in skipped:  # a glob over runs/ catches runs still going: named, not fatal
        print(f"skipped {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
